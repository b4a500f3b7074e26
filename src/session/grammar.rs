//! Grammars that force a tool call (`SetToolChoice` "required" or a tool's
//! name) or an output following a JSON schema (`SetOutputFormat`), in GBNF for llama.cpp's grammar sampler. The call takes the
//! `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` form the output
//! decoder parses. The object inside is described as a JSON schema — one
//! alternative per allowed tool, its `name` a constant and its `arguments`
//! the tool's own parameters schema — and turned into GBNF by a converter
//! (llama.cpp's `json_schema_to_grammar` in the daemon), so the arguments
//! follow the tool's schema. A schema the converter cannot take falls back to
//! "any JSON object" for the arguments.

use serde_json::{json, Value};

/// Turns a JSON schema into a GBNF grammar whose start rule is `root`.
pub type SchemaToGrammar<'a> = &'a dyn Fn(&str) -> Result<String, GrammarError>;

/// Why no grammar forces the call.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GrammarError {
    #[error("no tools are declared, so no call can be forced")]
    NoTools,
    #[error("the schema's grammar has no root rule")]
    NoRootRule,
    /// The converter refused the schema: its message.
    #[error("{0}")]
    Convert(String),
    /// A tool's or an output format's schema breaks a limit
    /// (`schema_limits`): which.
    #[error("the schema cannot become a grammar: {0}")]
    Limit(String),
    /// The converter has not run on this schema yet: the daemon converts it
    /// off the actor thread and plans again.
    #[error("the schema's grammar is not built yet")]
    Pending,
}

/// Anchors each unanchored `pattern` of `schema` in place; whether one
/// changed. A JSON Schema pattern matches anywhere in the string, and
/// llama.cpp's converter takes only `^...$` ones: any other it replaced
/// by "any string" (a warning nobody saw), so the reply ignored it. Here
/// `abc` becomes `^F(?:abc)F$`, `^abc` `^(?:abc)F$`, `abc$` `^F(?:abc)$`,
/// F any run of characters a JSON string holds as themselves: the same
/// strings, but those that need an escape around the match. Values that
/// are data, not schemas (`const`, `enum`, `default`, `examples`), are left
/// as they are.
pub fn anchor_patterns(schema: &mut Value) -> bool {
    match schema {
        Value::Object(map) => {
            let mut changed = false;
            for (key, v) in map.iter_mut() {
                match (key.as_str(), v) {
                    ("const" | "enum" | "default" | "examples", _) => {}
                    ("pattern", Value::String(p)) => {
                        let safe = json_safe(p);
                        let new = anchored(&safe).unwrap_or(safe);
                        if new != *p {
                            *p = new;
                            changed = true;
                        }
                    }
                    (_, v) => changed |= anchor_patterns(v),
                }
            }
            changed
        }
        Value::Array(items) => items
            .iter_mut()
            .fold(false, |changed, v| anchor_patterns(v) | changed),
        _ => false,
    }
}

/// `pattern` with what it lets be any character kept to characters a
/// JSON string holds as themselves: llama.cpp's converter applies a
/// pattern to the string as written, so `.` or `[^@]` let the model write
/// a bare `"` (ending the string early) or a lone `\`. `.` outside a class
/// becomes [`ANY_CHAR`], and a negated class excludes those characters too.
/// A character the pattern names itself (`\\`, `"` in a class) is left as
/// it is.
fn json_safe(pattern: &str) -> String {
    const EXCLUDED: &str = r#""\\\x7F\x00-\x1F"#;
    let mut out = String::with_capacity(pattern.len());
    let mut chars = pattern.chars().peekable();
    let mut in_class = false;
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                out.push(c);
                if let Some(next) = chars.next() {
                    out.push(next);
                }
            }
            '[' if !in_class => {
                in_class = true;
                out.push(c);
                if chars.peek() == Some(&'^') {
                    chars.next();
                    out.push('^');
                    out.push_str(EXCLUDED);
                }
            }
            ']' if in_class => {
                in_class = false;
                out.push(c);
            }
            '.' if !in_class => out.push_str(ANY_CHAR),
            _ => out.push(c),
        }
    }
    out
}

/// `pattern` anchored at both ends, if it is not.
fn anchored(pattern: &str) -> Option<String> {
    let start = pattern.starts_with('^');
    // A `$` after an odd number of backslashes is a dollar sign.
    let end = pattern.ends_with('$')
        && pattern[..pattern.len() - 1]
            .chars()
            .rev()
            .take_while(|&c| c == '\\')
            .count()
            % 2
            == 0;
    if start && end && pattern.len() >= 2 {
        return None;
    }
    let inner = &pattern[usize::from(start)..pattern.len() - usize::from(end)];
    if inner.is_empty() {
        return Some(format!("^{ANY_CHAR}*$"));
    }
    Some(format!(
        "^{}(?:{inner}){}$",
        if start { "" } else { FILL },
        if end { "" } else { FILL }
    ))
}

/// A character of a JSON string written as itself (the converter's own
/// `char`, less escapes): not `.`, which the converter lets be a `"` or a
/// `\` and so ends the string early or breaks it.
const ANY_CHAR: &str = r#"[^"\\\x7F\x00-\x1F]"#;
/// Any run of them.
const FILL: &str = r#"[^"\\\x7F\x00-\x1F]*"#;

/// The first local `$ref` in `schema` ("#/definitions/x", a JSON pointer
/// into the schema itself) that resolves to nothing, depth first; `"#"` is
/// the root. Other refs are left to the converter.
pub fn unresolved_ref(schema: &Value) -> Option<String> {
    fn walk<'a>(root: &Value, v: &'a Value) -> Option<&'a str> {
        match v {
            Value::Object(o) => {
                if let Some(Value::String(r)) = o.get("$ref") {
                    if let Some(pointer) = r.strip_prefix('#') {
                        if !pointer.is_empty() && root.pointer(pointer).is_none() {
                            return Some(r);
                        }
                    }
                }
                o.values().find_map(|child| walk(root, child))
            }
            Value::Array(a) => a.iter().find_map(|child| walk(root, child)),
            _ => None,
        }
    }
    walk(schema, schema).map(str::to_owned)
}

/// A declared tool's name and parameters schema, from an OpenAI function
/// tool, a bare function or an Anthropic tool.
pub fn tool_signature(json: &str) -> Option<(String, Value)> {
    let v: Value = serde_json::from_str(json).ok()?;
    let f = v.get("function").unwrap_or(&v);
    let name = f.get("name")?.as_str()?.to_string();
    let params = f
        .get("parameters")
        .or_else(|| f.get("input_schema"))
        .cloned()
        .unwrap_or_else(|| json!({"type": "object"}));
    Some((name, params))
}

/// A declared tool's name.
pub fn tool_name(json: &str) -> Option<String> {
    tool_signature(json).map(|(name, _)| name)
}

/// A GBNF string literal of `text`.
fn literal(text: &str) -> String {
    let mut out = String::from("\"");
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The schema of one call object for each allowed tool.
fn call_schema(tools: &[(String, Value)], any_arguments: bool) -> Value {
    let alternatives: Vec<Value> = tools
        .iter()
        .map(|(name, params)| {
            let arguments = if any_arguments {
                json!({"type": "object"})
            } else {
                params.clone()
            };
            json!({
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": arguments},
                "required": ["name", "arguments"],
                "additionalProperties": false
            })
        })
        .collect();
    if alternatives.len() == 1 {
        alternatives.into_iter().next().expect("one")
    } else {
        json!({ "anyOf": alternatives })
    }
}

/// `grammar` with its start rule `root` renamed to `name`, so that another
/// root can put it after something; `None` when it has no root rule.
pub fn rename_root(grammar: &str, name: &str) -> Option<String> {
    let mut renamed = String::new();
    let mut found = false;
    for line in grammar.lines() {
        match line.strip_prefix("root ::=") {
            Some(rest) if !found => {
                found = true;
                renamed.push_str(name);
                renamed.push_str(" ::=");
                renamed.push_str(rest);
            }
            _ => renamed.push_str(line),
        }
        renamed.push('\n');
    }
    found.then_some(renamed)
}

/// The grammar forcing one call to one of `tools` (name and parameters
/// schema). `close_reasoning` is the thinking block's closing marker when the
/// turn is inside one: the grammar closes it first.
pub fn forced_call(
    tools: &[(String, Value)],
    close_reasoning: Option<&str>,
    convert: SchemaToGrammar,
) -> Result<String, GrammarError> {
    if tools.is_empty() {
        return Err(GrammarError::NoTools);
    }
    for (name, params) in tools {
        if let Some(why) = crate::session::schema_limits::check_schema(params) {
            return Err(GrammarError::Limit(format!("{name}: {why}")));
        }
    }
    let body = match convert(&call_schema(tools, false).to_string()) {
        Ok(g) => g,
        Err(GrammarError::Pending) => return Err(GrammarError::Pending),
        Err(e) => {
            log::warn!(
                "a tool's parameters schema has no grammar ({e}); forcing any JSON arguments"
            );
            convert(&call_schema(tools, true).to_string())?
        }
    };
    // The converter's start rule becomes `call-object`, under our own root.
    let renamed = rename_root(&body, "call-object").ok_or(GrammarError::NoRootRule)?;
    let open = match close_reasoning {
        Some(close) => format!("{} ", literal(&format!("{close}\n\n"))),
        None => String::new(),
    };
    Ok(format!(
        "root ::= {open}\"<tool_call>\\n\" call-object \"\\n</tool_call>\"\n{renamed}"
    ))
}

/// The grammar forcing output that follows the JSON `schema`, after
/// `close_reasoning` (the thinking block's closing marker) when the turn is
/// inside one.
pub fn json_format(
    schema: &Value,
    close_reasoning: Option<&str>,
    convert: SchemaToGrammar,
) -> Result<String, GrammarError> {
    if let Some(why) = crate::session::schema_limits::check_schema(schema) {
        return Err(GrammarError::Limit(why));
    }
    let body = convert(&schema.to_string())?;
    match close_reasoning {
        None => Ok(body),
        Some(close) => {
            let renamed = rename_root(&body, "answer").ok_or(GrammarError::NoRootRule)?;
            let open = literal(&format!("{close}\n\n"));
            Ok(format!("root ::= {open} answer\n{renamed}"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unanchored_patterns_are_anchored_to_match_the_same_strings() {
        let mut v = json!({"type": "object", "properties": {
            "a": {"type": "string", "pattern": "abc"},
            "b": {"type": "string", "pattern": "^abc"},
            "c": {"type": "string", "pattern": "abc$"},
            "d": {"type": "string", "pattern": "^abc$"},
            "e": {"type": "string", "pattern": "cost \\$"},
            "pattern": {"type": "string"},
            "f": {"const": {"pattern": "x"}, "enum": [{"pattern": "y"}]}
        }});
        assert!(anchor_patterns(&mut v));
        let p = |k: &str| v["properties"][k]["pattern"].as_str().unwrap().to_owned();
        assert_eq!(p("a"), format!("^{FILL}(?:abc){FILL}$"));
        assert_eq!(p("b"), format!("^(?:abc){FILL}$"));
        assert_eq!(p("c"), format!("^{FILL}(?:abc)$"));
        assert_eq!(p("d"), "^abc$");
        assert_eq!(p("e"), format!("^{FILL}(?:cost \\$){FILL}$"));
        assert_eq!(v["properties"]["pattern"], json!({"type": "string"}));
        assert_eq!(v["properties"]["f"]["const"], json!({"pattern": "x"}));
        assert_eq!(v["properties"]["f"]["enum"], json!([{"pattern": "y"}]));
        let mut plain = json!({"type": "string", "pattern": "^[0-9]{5}$"});
        assert!(!anchor_patterns(&mut plain));
        // What a pattern lets be any character is kept off `"`, `\\` and
        // control characters, which would end or break the JSON string.
        let mut v = json!({"pattern": "^She.*[^@]+\\.x[.]$"});
        assert!(anchor_patterns(&mut v));
        assert_eq!(
            v["pattern"],
            format!("^She{ANY_CHAR}*[^\"\\\\\\x7F\\x00-\\x1F@]+\\.x[.]$")
        );
        // One character: `^` alone and `$` alone.
        let mut v = json!({"pattern": "^"});
        assert!(anchor_patterns(&mut v));
        assert_eq!(v["pattern"], format!("^{ANY_CHAR}*$"));
    }

    #[test]
    fn a_local_ref_to_nothing_is_found() {
        let ok = json!({"$defs": {"a": {"type": "string"}, "b~/c": {}},
            "properties": {"x": {"$ref": "#/$defs/a"}, "y": {"$ref": "#"},
                "z": {"$ref": "#/$defs/b~0~1c"}, "r": {"$ref": "other.json"}}});
        assert_eq!(unresolved_ref(&ok), None);
        let bad = json!({"anyOf": [{"type": "null"}, {"items": {"$ref": "#/$defs/gone"}}]});
        assert_eq!(unresolved_ref(&bad).as_deref(), Some("#/$defs/gone"));
    }

    #[test]
    fn signatures_of_the_three_tool_shapes() {
        let (n, p) = tool_signature(
            r#"{"type":"function","function":{"name":"a","parameters":{"type":"object","properties":{"x":{"type":"string"}}}}}"#,
        )
        .unwrap();
        assert_eq!(
            (n.as_str(), p["properties"]["x"]["type"].as_str()),
            ("a", Some("string"))
        );
        assert_eq!(
            tool_name(r#"{"name":"b","parameters":{}}"#).as_deref(),
            Some("b")
        );
        let (n, p) = tool_signature(r#"{"name":"c","input_schema":{"type":"object"}}"#).unwrap();
        assert_eq!((n.as_str(), p["type"].as_str()), ("c", Some("object")));
        assert_eq!(tool_name("nope"), None);
    }

    #[test]
    fn wraps_the_converted_schema_and_closes_reasoning() {
        let seen = std::cell::RefCell::new(Vec::new());
        let convert = |schema: &str| -> Result<String, GrammarError> {
            seen.borrow_mut().push(schema.to_string());
            Ok("root ::= \"{\" space \"}\"\nspace ::= \" \"?\n".into())
        };
        let tools = vec![("get_weather".to_string(), json!({"type":"object"}))];
        let g = forced_call(&tools, Some("</think>"), &convert).unwrap();
        assert!(
            g.starts_with("root ::= \"</think>\\n\\n\" \"<tool_call>\\n\" call-object"),
            "{g}"
        );
        assert!(g.contains("call-object ::= \"{\" space \"}\""), "{g}");
        let schema: Value = serde_json::from_str(&seen.borrow()[0]).unwrap();
        assert_eq!(schema["properties"]["name"]["const"], "get_weather");
        assert_eq!(forced_call(&[], None, &convert), Err(GrammarError::NoTools));
        // Two tools: one alternative each.
        let two = vec![tools[0].clone(), ("b".to_string(), json!({}))];
        forced_call(&two, None, &convert).unwrap();
        let schema: Value = serde_json::from_str(&seen.borrow()[1]).unwrap();
        assert_eq!(schema["anyOf"].as_array().unwrap().len(), 2);
    }

    #[test]
    fn a_json_format_closes_reasoning_before_the_answer() {
        let convert = |_: &str| -> Result<String, GrammarError> { Ok("root ::= \"{}\"\n".into()) };
        let schema = json!({"type": "object"});
        assert_eq!(
            json_format(&schema, None, &convert).unwrap(),
            "root ::= \"{}\"\n"
        );
        let g = json_format(&schema, Some("</think>"), &convert).unwrap();
        assert!(
            g.starts_with("root ::= \"</think>\\n\\n\" answer\nanswer ::= \"{}\""),
            "{g}"
        );
        let refuse =
            |_: &str| -> Result<String, GrammarError> { Err(GrammarError::Convert("no".into())) };
        assert_eq!(
            json_format(&schema, None, &refuse),
            Err(GrammarError::Convert("no".into()))
        );
    }

    #[test]
    fn falls_back_to_any_arguments_when_a_schema_fails() {
        let convert = |schema: &str| -> Result<String, GrammarError> {
            if schema.contains("\"minLength\"") {
                Err(GrammarError::Convert("unsupported".into()))
            } else {
                Ok("root ::= \"{}\"\n".into())
            }
        };
        let tools = vec![(
            "t".to_string(),
            json!({"type":"object","properties":{"a":{"type":"string","minLength":1}}}),
        )];
        assert!(forced_call(&tools, None, &convert)
            .unwrap()
            .contains("call-object ::= \"{}\""));
    }
}
