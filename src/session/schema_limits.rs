//! Caps on a declared tool's parameters schema, checked at `AppendSystem`
//! (and again before any schema becomes a grammar, for logs written before
//! the caps). A schema becomes a GBNF grammar when a call is forced, and
//! llama.cpp's converter and grammar parser grow with the schema: its size,
//! its properties, its depth and its repetition bounds (`minLength: 3000`
//! becomes 3000 copies of a rule). Pure: a tool's JSON in, the first limit
//! it breaks out, named.

use serde_json::Value;

/// The most bytes of one tool's JSON.
pub const MAX_TOOL_BYTES: usize = 64 << 10;
/// The most bytes of all of a system turn's tools together.
pub const MAX_TOOLS_BYTES: usize = 256 << 10;
/// The most tools one system turn declares.
pub const MAX_TOOLS: usize = 128;
/// The most properties one tool's schema declares, at every depth together.
pub const MAX_PROPERTIES: usize = 256;
/// The most JSON values (objects, arrays, strings, numbers...) in one schema.
pub const MAX_SCHEMA_NODES: usize = 4096;
/// The deepest nesting of one schema.
pub const MAX_DEPTH: usize = 16;
/// The largest repetition bound (`minLength`, `maxLength`, `minItems`,
/// `maxItems`, `minProperties`, `maxProperties`, `{n}` in a `pattern`).
/// llama.cpp's grammar parser refuses repetitions past 2000.
pub const MAX_REPETITION: u64 = 1000;
/// The longest key (a property's or a definition's name) and `$ref`, in
/// bytes. llama.cpp's converter makes rule names of them through a
/// `std::regex_replace` that recurses once per character: a 10,000-byte
/// property name overflowed the daemon's stack and killed it.
pub const MAX_NAME_BYTES: usize = 256;
/// The longest `pattern`, in bytes (the converter parses it by hand and
/// logs it whole when it refuses it).
pub const MAX_PATTERN_BYTES: usize = 4096;

const REPETITION_KEYS: [&str; 6] = [
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
];

/// Keys whose values are data, not schemas.
const DATA_KEYS: [&str; 4] = ["const", "enum", "default", "examples"];

/// Lower and upper bounds of one value: a schema whose lower bound is above
/// its upper one allows nothing.
const BOUND_PAIRS: [(&str, &str); 4] = [
    ("minLength", "maxLength"),
    ("minItems", "maxItems"),
    ("minProperties", "maxProperties"),
    ("minimum", "maximum"),
];

/// The first limit `tools` (each one tool's JSON) breaks, as a sentence
/// naming it; None when all are within the caps. A tool that is not JSON
/// is left to the template's own check.
pub fn check_tools(tools: &[String]) -> Option<String> {
    if tools.len() > MAX_TOOLS {
        return Some(format!(
            "{} tools declared, over the limit of {MAX_TOOLS} tools",
            tools.len()
        ));
    }
    let total: usize = tools.iter().map(String::len).sum();
    if total > MAX_TOOLS_BYTES {
        return Some(format!(
            "the tools take {total} bytes, over the limit of {MAX_TOOLS_BYTES} bytes"
        ));
    }
    for (i, tool) in tools.iter().enumerate() {
        if tool.len() > MAX_TOOL_BYTES {
            return Some(format!(
                "tool {i} takes {} bytes, over the limit of {MAX_TOOL_BYTES} bytes a tool",
                tool.len()
            ));
        }
        // serde_json refuses nesting past 128 on its own, before we walk it.
        let Ok(value) = serde_json::from_str::<Value>(tool) else {
            continue;
        };
        if let Some(why) = check_schema(&value) {
            return Some(format!("tool {i}'s schema: {why}"));
        }
    }
    None
}

/// The first limit one schema (or a whole tool object) breaks: the limits
/// above, and [`MAX_TOOL_BYTES`] for the whole of it (a `response_format`
/// as much as a tool).
pub fn check_schema(value: &Value) -> Option<String> {
    let mut count = Count::default();
    if let Some(why) = walk(value, 1, &mut count, false) {
        return Some(why);
    }
    let bytes = value.to_string().len();
    (bytes > MAX_TOOL_BYTES)
        .then(|| format!("it takes {bytes} bytes, over the limit of {MAX_TOOL_BYTES} bytes"))
}

#[derive(Default)]
struct Count {
    nodes: usize,
    properties: usize,
}

/// `data`: inside a value that is data, not a schema (`const`, `enum`,
/// `default`, `examples`): counted, but its keys bound nothing.
fn walk(value: &Value, depth: usize, count: &mut Count, data: bool) -> Option<String> {
    count.nodes += 1;
    if count.nodes > MAX_SCHEMA_NODES {
        return Some(format!(
            "more than {MAX_SCHEMA_NODES} JSON values, the limit"
        ));
    }
    if depth > MAX_DEPTH {
        return Some(format!("nested deeper than {MAX_DEPTH} levels, the limit"));
    }
    match value {
        Value::Object(map) => {
            if let Some(key) = map.keys().find(|k| k.len() > MAX_NAME_BYTES) {
                return Some(format!(
                    "a key of {} bytes, over the limit of {MAX_NAME_BYTES} bytes a name",
                    key.len()
                ));
            }
            if let Some(Value::String(r)) = map.get("$ref") {
                if r.len() > MAX_NAME_BYTES {
                    return Some(format!(
                        "a \"$ref\" of {} bytes, over the limit of {MAX_NAME_BYTES} bytes a name",
                        r.len()
                    ));
                }
            }
            if let Some(Value::Object(props)) = map.get("properties") {
                count.properties += props.len();
                if count.properties > MAX_PROPERTIES {
                    return Some(format!("more than {MAX_PROPERTIES} properties, the limit"));
                }
            }
            for key in REPETITION_KEYS.iter().filter(|_| !data) {
                if let Some(n) = map.get(*key).and_then(Value::as_f64) {
                    if n > MAX_REPETITION as f64 {
                        return Some(format!(
                            "\"{key}\": {n} is over the limit of {MAX_REPETITION} for a repetition bound"
                        ));
                    }
                }
            }
            for (low, high) in BOUND_PAIRS.iter().filter(|_| !data) {
                let (Some(a), Some(b)) = (
                    map.get(*low).and_then(Value::as_f64),
                    map.get(*high).and_then(Value::as_f64),
                ) else {
                    continue;
                };
                // llama.cpp's parser would write `{a,b}` out until memory
                // runs out (b - a wraps), or the grammar allows nothing.
                if a > b {
                    return Some(format!(
                        "\"{low}\": {a} is more than \"{high}\": {b}; nothing can follow it"
                    ));
                }
            }
            if let Some(Value::String(p)) = map.get("pattern").filter(|_| !data) {
                if p.len() > MAX_PATTERN_BYTES {
                    return Some(format!(
                        "a \"pattern\" of {} bytes, over the limit of {MAX_PATTERN_BYTES} bytes",
                        p.len()
                    ));
                }
                if let Some(n) = largest_braced_number(p).filter(|&n| n > MAX_REPETITION) {
                    return Some(format!(
                        "a \"pattern\" repeats {{{n}}}, over the limit of {MAX_REPETITION} for a repetition bound"
                    ));
                }
            }
            map.iter().find_map(|(k, v)| {
                let data = data || DATA_KEYS.contains(&k.as_str());
                walk(v, depth + 1, count, data)
            })
        }
        Value::Array(items) => items.iter().find_map(|v| walk(v, depth + 1, count, data)),
        _ => None,
    }
}

/// The largest number written inside `{...}` in a regular expression.
fn largest_braced_number(pattern: &str) -> Option<u64> {
    let mut largest = None;
    let mut in_brace = false;
    let mut current: Option<u64> = None;
    for c in pattern.chars() {
        match c {
            '{' => {
                in_brace = true;
                current = None;
            }
            '}' | ',' if in_brace => {
                if let Some(n) = current.take() {
                    largest = largest.max(Some(n));
                }
                in_brace = c == ',';
            }
            d if in_brace && d.is_ascii_digit() => {
                let digit = u64::from(d as u8 - b'0');
                current = Some(
                    current
                        .unwrap_or(0)
                        .saturating_mul(10)
                        .saturating_add(digit),
                );
            }
            _ => {
                in_brace = false;
                current = None;
            }
        }
    }
    largest
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tool(params: Value) -> String {
        json!({"type": "function", "function": {"name": "t", "parameters": params}}).to_string()
    }

    #[test]
    fn ordinary_tools_pass() {
        let t = tool(json!({"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 200},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 10},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}
        }}));
        assert_eq!(check_tools(&[t]), None);
        assert_eq!(check_tools(&["not json".into()]), None);
    }

    #[test]
    fn each_limit_is_named() {
        let props: serde_json::Map<String, Value> = (0..5000)
            .map(|i| (format!("p{i}"), json!({"type": "string"})))
            .collect();
        let why = check_tools(&[tool(json!({"type": "object", "properties": props}))]).unwrap();
        assert!(why.contains("bytes") || why.contains("properties"), "{why}");
        let props: serde_json::Map<String, Value> =
            (0..300).map(|i| (format!("p{i}"), json!({}))).collect();
        let why = check_tools(&[tool(json!({"properties": props}))]).unwrap();
        assert!(why.contains("256 properties"), "{why}");
        let why = check_tools(&[tool(json!({"properties": {"a": {"minLength": 3000}}}))]).unwrap();
        assert!(why.contains("\"minLength\": 3000"), "{why}");
        // A lower bound above the upper one: llama.cpp's parser wrote
        // `{2,1}` out until the worker's memory ran out.
        let why = check_schema(&json!({"type": "string", "minLength": 2, "maxLength": 1})).unwrap();
        assert!(
            why.contains("\"minLength\": 2 is more than \"maxLength\": 1"),
            "{why}"
        );
        let why =
            check_schema(&json!({"properties": {"n": {"minimum": 5, "maximum": 1}}})).unwrap();
        assert!(why.contains("\"minimum\": 5"), "{why}");
        assert_eq!(check_schema(&json!({"minItems": 2, "maxItems": 2})), None);
        // Data, not a schema: its keys bound nothing.
        assert_eq!(
            check_schema(&json!({"default": {"minimum": 10, "maximum": 0},
                "examples": [{"minLength": 3000}], "const": {"minItems": 3, "maxItems": 1}})),
            None
        );
        assert_eq!(
            check_schema(&json!({"properties": {"minimum": {"type": "number"}, "maximum": {}}})),
            None
        );
        let why = check_tools(&[tool(json!({"pattern": "a{1,5000}"}))]).unwrap();
        assert!(why.contains("{5000}"), "{why}");
        let mut deep = json!({"type": "string"});
        for _ in 0..20 {
            deep = json!({"type": "array", "items": deep});
        }
        let why = check_tools(&[tool(deep)]).unwrap();
        assert!(why.contains("16 levels"), "{why}");
        let many = vec![tool(json!({})); 200];
        assert!(check_tools(&many).unwrap().contains("128 tools"));
        // Names, $ref and patterns: long ones overflowed the converter's
        // stack; each is refused before it gets there.
        let long = "_".repeat(MAX_NAME_BYTES + 1);
        let why = check_schema(&json!({"properties": {long.clone(): {}}})).unwrap();
        assert!(why.contains("a key of 257 bytes"), "{why}");
        let why = check_schema(&json!({"$defs": {long.clone(): {}}})).unwrap();
        assert!(why.contains("a key of 257 bytes"), "{why}");
        let why = check_schema(&json!({"$ref": format!("#/$defs/{long}")})).unwrap();
        assert!(why.contains("\"$ref\" of 265 bytes"), "{why}");
        let why = check_schema(&json!({"pattern": "a".repeat(MAX_PATTERN_BYTES + 1)})).unwrap();
        assert!(why.contains("4097 bytes"), "{why}");
        let fine = "_".repeat(MAX_NAME_BYTES);
        assert_eq!(check_schema(&json!({"properties": {fine: {}}})), None);
        // A schema over a tool's bytes, in few values (a long description).
        let why = check_schema(&json!({"description": "x".repeat(MAX_TOOL_BYTES)})).unwrap();
        assert!(why.contains("over the limit of 65536 bytes"), "{why}");
    }

    #[test]
    fn braced_numbers() {
        assert_eq!(largest_braced_number("a{3}b{2,40}"), Some(40));
        assert_eq!(largest_braced_number("{x}"), None);
        assert_eq!(largest_braced_number("plain"), None);
    }
}
