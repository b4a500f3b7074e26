//! Grammars that force a tool call (`SetToolChoice` "required" or a tool's
//! name), in GBNF for llama.cpp's grammar sampler. The call takes the
//! `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` form the output
//! decoder parses; `name` is one of the declared tools and `arguments` any
//! JSON object (the tool's schema is not enforced).

/// The name of a declared tool: an OpenAI function tool, a bare function or
/// an Anthropic tool.
pub fn tool_name(json: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(json).ok()?;
    v.get("function")
        .and_then(|f| f.get("name"))
        .or_else(|| v.get("name"))
        .and_then(|n| n.as_str())
        .map(str::to_string)
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

const JSON_RULES: &str = r#"obj ::= "{" ws ( str ":" ws value ( "," ws str ":" ws value )* )? "}" ws
value ::= obj | arr | str | num | ( "true" | "false" | "null" ) ws
arr ::= "[" ws ( value ( "," ws value )* )? "]" ws
str ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] ) )* "\"" ws
num ::= "-"? ( [0-9] | [1-9] [0-9] [0-9]? [0-9]? [0-9]? [0-9]? ) ( "." [0-9]+ )? ( [eE] [-+]? [0-9]+ )? ws
ws ::= ( " " | "\n" )?
"#;

/// The grammar forcing one call to one of `names`. `close_reasoning` is the
/// thinking block's closing marker when the turn is inside one: the grammar
/// closes it first.
pub fn forced_call(names: &[String], close_reasoning: Option<&str>) -> Result<String, String> {
    if names.is_empty() {
        return Err("no tools are declared, so no call can be forced".into());
    }
    let alternatives: Vec<String> = names.iter().map(|n| literal(n)).collect();
    let open = match close_reasoning {
        Some(close) => format!("{} ", literal(&format!("{close}\n\n"))),
        None => String::new(),
    };
    Ok(format!(
        "root ::= {open}\"<tool_call>\\n{{\\\"name\\\": \\\"\" name \"\\\", \\\"arguments\\\": \" obj \"}}\\n</tool_call>\"\nname ::= {}\n{JSON_RULES}",
        alternatives.join(" | ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_of_the_three_tool_shapes() {
        assert_eq!(
            tool_name(r#"{"type":"function","function":{"name":"a","parameters":{}}}"#).as_deref(),
            Some("a")
        );
        assert_eq!(
            tool_name(r#"{"name":"b","parameters":{}}"#).as_deref(),
            Some("b")
        );
        assert_eq!(
            tool_name(r#"{"name":"c","input_schema":{}}"#).as_deref(),
            Some("c")
        );
        assert_eq!(tool_name("nope"), None);
    }

    #[test]
    fn grammar_lists_the_names_and_closes_reasoning() {
        let g = forced_call(
            &["get_weather".into(), "say \"hi\"".into()],
            Some("</think>"),
        )
        .unwrap();
        assert!(
            g.starts_with("root ::= \"</think>\\n\\n\" \"<tool_call>"),
            "{g}"
        );
        assert!(
            g.contains("name ::= \"get_weather\" | \"say \\\"hi\\\"\""),
            "{g}"
        );
        assert!(forced_call(&[], None).is_err());
    }
}
