//! Chat templates: the model's Jinja `tokenizer.chat_template` rendered with minijinja, set up
//! the way Hugging Face `transformers` renders it (`trim_blocks`, `lstrip_blocks`, Python string
//! methods, `raise_exception`, `strftime_now`, a `tojson` that writes what Python's `json.dumps`
//! writes, globals `bos_token`/`eos_token`), and tool definitions normalised to the OpenAI form.

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Serde};
use minijinja::{Environment, Error, ErrorKind, Value};
use serde_json::{json, Map, Value as Json};

use super::EngineError;

pub use crate::session::ChatMessage;

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// The template writes out the tools it is given. When it does not
    /// (SmolLM2's, many base models'), [`ChatTemplate::render`] declares
    /// them itself, Hermes-style, so the model sees what it may call.
    declares_tools: bool,
    /// The template takes a system message (Gemma's and older Mistral's
    /// raise on one): where [`tool_block`] goes, in a system message or at
    /// the start of the first message.
    takes_system: bool,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

const TEMPLATE_NAME: &str = "chat_template";

impl ChatTemplate {
    /// Compile `source` (a Jinja chat template); `bos_token`/`eos_token` are the texts of the
    /// model's BOS/EOS tokens (empty when it has none), exposed to the template as globals.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, EngineError> {
        let mut env = Environment::new();
        // transformers compiles chat templates with trim_blocks and lstrip_blocks.
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| EngineError::TemplateSyntax(e.to_string()))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_global("bos_token", bos_token.to_owned());
        env.add_global("eos_token", eos_token.to_owned());
        env.add_template_owned(TEMPLATE_NAME, source.to_owned())
            .map_err(|e| EngineError::TemplateSyntax(describe(&e)))?;
        let mut t = Self {
            env,
            declares_tools: true,
            takes_system: true,
        };
        // Asked of the template itself, by rendering: a probe tool's name in
        // the text means it writes tools out (reading `tools` is not enough:
        // `{% set tools = tools or [] %}` reads it, and some read it only to
        // refuse it).
        let user = [ChatMessage::new(crate::wire::Role::User, "x")];
        let probe = json!({"type": "function", "function": {"name": PROBE_TOOL, "parameters": {"type": "object"}}});
        t.declares_tools = t
            .render_as_given(&user, std::slice::from_ref(&probe), false)
            .is_ok_and(|text| text.contains(PROBE_TOOL));
        let with_system = [
            ChatMessage::new(crate::wire::Role::System, "s"),
            user[0].clone(),
        ];
        t.takes_system = t.render_as_given(&with_system, &[], false).is_ok();
        Ok(t)
    }

    /// Whether the template writes out the tools it is given.
    pub fn declares_tools(&self) -> bool {
        self.declares_tools
    }

    /// Render `messages` (and `tools`, passed to the template only when non-empty, as
    /// transformers does) to the model's prompt text. A template that does not read `tools`
    /// gets them declared in the system message instead ([`tool_block`]).
    pub fn render(
        &self,
        messages: &[ChatMessage],
        tools: &[Json],
        add_generation_prompt: bool,
    ) -> Result<String, EngineError> {
        if tools.is_empty() || self.declares_tools {
            return self.render_as_given(messages, tools, add_generation_prompt);
        }
        let declared = with_tool_block(messages, tools, self.takes_system);
        self.render_as_given(&declared, &[], add_generation_prompt)
    }

    /// [`render`](Self::render) with `tools` passed to the template as they
    /// are.
    fn render_as_given(
        &self,
        messages: &[ChatMessage],
        tools: &[Json],
        add_generation_prompt: bool,
    ) -> Result<String, EngineError> {
        let msgs = messages
            .iter()
            .map(|m| Ok(json!({"role": m.role.name(), "content": m.content})))
            .collect::<Result<Vec<_>, EngineError>>()?;
        let mut ctx = Map::new();
        ctx.insert("messages".into(), Json::Array(msgs));
        ctx.insert(
            "add_generation_prompt".into(),
            Json::Bool(add_generation_prompt),
        );
        if !tools.is_empty() {
            ctx.insert("tools".into(), Json::Array(tools.to_vec()));
        }
        let tmpl = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| EngineError::TemplateRender(describe(&e)))?;
        tmpl.render(Value::from(Serde(Json::Object(ctx))))
            .map_err(|e| EngineError::TemplateRender(describe(&e)))
    }
}

/// The tools declared in words a model tuned on Hermes-style calls knows, and
/// in the call form the output decoder parses (`<tool_call>` blocks): each
/// tool's JSON on a line of its own.
pub fn tool_block(tools: &[Json]) -> String {
    let mut s = String::from(
        "# Tools\n\nYou may call the functions described below, one JSON schema a line:\n<tools>",
    );
    for t in tools {
        s.push('\n');
        s.push_str(&t.to_string());
    }
    s.push_str(
        "\n</tools>\n\nTo call one, write its name and arguments as a JSON object between \
         <tool_call> and </tool_call>:\n<tool_call>\n{\"name\": \"the function's name\", \
         \"arguments\": {\"parameter\": \"value\"}}\n</tool_call>",
    );
    s
}

/// The name of the tool [`ChatTemplate::new`] renders to learn whether a
/// template writes tools out.
const PROBE_TOOL: &str = "superfluid_probe_tool_5e3b";

/// `messages` with [`tool_block`] at the end of the opening system message
/// (after a blank line), or as a system message of its own before them; on a
/// template that takes no system message (`takes_system` false), at the
/// start of the first message, a blank line before its text.
fn with_tool_block(
    messages: &[ChatMessage],
    tools: &[Json],
    takes_system: bool,
) -> Vec<ChatMessage> {
    let block = tool_block(tools);
    let mut out = messages.to_vec();
    match out.first_mut() {
        Some(first) if first.role == crate::wire::Role::System => {
            if !first.content.is_empty() {
                first.content.push_str("\n\n");
            }
            first.content.push_str(&block);
        }
        Some(first) if !takes_system => {
            first.content = format!("{block}\n\n{}", first.content);
        }
        _ => out.insert(0, ChatMessage::new(crate::wire::Role::System, block)),
    }
    out
}

/// A minijinja error with its chain of causes and location.
fn describe(e: &Error) -> String {
    let mut s = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        s.push_str(": ");
        s.push_str(&cause.to_string());
        source = cause.source();
    }
    s
}

/// `raise_exception(msg)`: templates call it to reject a conversation.
fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// `strftime_now(format)`: the local time formatted with C `strftime`.
fn strftime_now(format: String) -> Result<String, Error> {
    let bad = || Error::new(ErrorKind::InvalidOperation, "strftime_now: invalid format");
    let fmt = std::ffi::CString::new(format).map_err(|_| bad())?;
    let mut buf = vec![0u8; 256];
    // SAFETY: `tm` is fully written by localtime_r; strftime writes at most `buf.len()` bytes.
    unsafe {
        let now = libc::time(std::ptr::null_mut());
        let mut tm: libc::tm = std::mem::zeroed();
        if libc::localtime_r(&now, &mut tm).is_null() {
            return Err(bad());
        }
        let n = libc::strftime(buf.as_mut_ptr().cast(), buf.len(), fmt.as_ptr(), &tm);
        buf.truncate(n);
    }
    String::from_utf8(buf).map_err(|_| bad())
}

/// `tojson` as transformers defines it: Python's `json.dumps(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`, so `{"a": 1, "b": [1, 2]}` (with spaces), key order kept.
fn tojson(value: Value, indent: Option<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let indent = match indent {
        Some(v) => Some(v),
        None => kwargs.get::<Option<Value>>("indent")?,
    };
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_owned()),
            None => Some(" ".repeat(usize::try_from(v)?)),
        },
    };
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    let separators = kwargs.get::<Option<Vec<String>>>("separators")?;
    kwargs.assert_all_used()?;
    let (item_sep, key_sep) = match separators {
        Some(s) if s.len() == 2 => (s[0].clone(), s[1].clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be a pair",
            ))
        }
        None if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        None => (", ".to_owned(), ": ".to_owned()),
    };
    let json = serde_json::to_value(&value).map_err(|e| {
        Error::new(ErrorKind::BadSerialization, "tojson: cannot serialize").with_source(e)
    })?;
    let style = PyJson {
        indent,
        item_sep,
        key_sep,
        sort_keys,
        ensure_ascii,
    };
    let mut out = String::new();
    style.write(&json, 0, &mut out);
    Ok(Value::from(out))
}

/// Python `json.dumps` formatting options.
struct PyJson {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

impl PyJson {
    fn newline(&self, level: usize, out: &mut String) {
        if let Some(ind) = &self.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(ind);
            }
        }
    }

    fn write(&self, v: &Json, level: usize, out: &mut String) {
        match v {
            Json::Null => out.push_str("null"),
            Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Json::Number(n) => out.push_str(&n.to_string()),
            Json::String(s) => self.write_str(s, out),
            Json::Array(items) if items.is_empty() => out.push_str("[]"),
            Json::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(level + 1, out);
                    self.write(item, level + 1, out);
                }
                self.newline(level, out);
                out.push(']');
            }
            Json::Object(map) if map.is_empty() => out.push_str("{}"),
            Json::Object(map) => {
                let mut entries: Vec<(&String, &Json)> = map.iter().collect();
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                out.push('{');
                for (i, (k, item)) in entries.into_iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(level + 1, out);
                    self.write_str(k, out);
                    out.push_str(&self.key_sep);
                    self.write(item, level + 1, out);
                }
                self.newline(level, out);
                out.push('}');
            }
        }
    }

    fn write_str(&self, s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ensure_ascii && !c.is_ascii()) => {
                    let mut units = [0u16; 2];
                    for u in c.encode_utf16(&mut units) {
                        out.push_str(&format!("\\u{u:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// Normalise a tool definition to the OpenAI function-tool form
/// `{"type": "function", "function": {"name", "description"?, "parameters"}}`.
///
/// Accepts that form, a bare function `{name, description, parameters}`, and an Anthropic tool
/// `{name, description, input_schema}` (optionally with `"type": "custom"`). A tool without
/// parameters gets the empty object schema. Anything else is an error naming the problem.
pub fn normalize_tool(json: &str) -> Result<Json, EngineError> {
    let bad = |msg: &str| EngineError::InvalidTool(msg.to_owned());
    let value: Json = serde_json::from_str(json)
        .map_err(|e| EngineError::InvalidTool(format!("not valid JSON: {e}")))?;
    let obj = value
        .as_object()
        .ok_or_else(|| bad("a tool must be a JSON object"))?;
    let func = match obj.get("type") {
        Some(Json::String(t)) if t == "function" => {
            obj.get("function")
                .and_then(Json::as_object)
                .ok_or_else(|| bad("a \"type\": \"function\" tool needs a \"function\" object"))?
        }
        Some(Json::String(t)) if t == "custom" => obj,
        None => obj,
        Some(Json::String(t)) => {
            return Err(EngineError::InvalidTool(format!(
                "unsupported tool type {t:?} (expected \"function\")"
            )))
        }
        Some(_) => return Err(bad("the tool's \"type\" must be a string")),
    };
    let name = match func.get("name") {
        Some(Json::String(n)) if !n.trim().is_empty() => n.clone(),
        Some(Json::String(_)) => return Err(bad("the tool's name is empty")),
        Some(_) => return Err(bad("the tool's \"name\" must be a string")),
        None => return Err(bad("the tool has no \"name\"")),
    };
    let mut out = Map::new();
    out.insert("name".into(), Json::String(name));
    match func.get("description") {
        None | Some(Json::Null) => {}
        Some(Json::String(d)) => {
            out.insert("description".into(), Json::String(d.clone()));
        }
        Some(_) => return Err(bad("the tool's \"description\" must be a string")),
    }
    let params = match (func.get("parameters"), func.get("input_schema")) {
        (Some(p), _) | (None, Some(p)) if p.is_object() => p.clone(),
        (None, None) | (Some(Json::Null), _) | (None, Some(Json::Null)) => {
            json!({"type": "object", "properties": {}})
        }
        _ => {
            return Err(bad(
                "the tool's parameters / input_schema must be a JSON object",
            ))
        }
    };
    out.insert("parameters".into(), params);
    Ok(json!({"type": "function", "function": Json::Object(out)}))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::Role;

    const CHATML_TOOLS: &str = r##"{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{ messages[0].content + '\n\n' }}{% endif %}
{{- "# Tools\n\n<tools>" }}
{%- for tool in tools %}
{{- "\n" + (tool | tojson) }}
{%- endfor %}
{{- "\n</tools><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if not (message.role == 'system' and loop.first) %}
{{- '<|im_start|>' + message.role + '\n' + message.content.strip() + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"##;

    #[test]
    fn renders_tools_with_python_json() {
        let t = ChatTemplate::new(CHATML_TOOLS, "", "<|im_end|>").unwrap();
        let tool = normalize_tool(
            r#"{"name":"get_weather","description":"Weather","input_schema":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}"#,
        )
        .unwrap();
        let msgs = [
            ChatMessage::new(Role::System, "Be brief."),
            ChatMessage::new(Role::User, "  weather in Paris?  "),
        ];
        let out = t.render(&msgs, &[tool], true).unwrap();
        let expected = "<|im_start|>system\nBe brief.\n\n# Tools\n\n<tools>\n\
            {\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Weather\", \
            \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}, \"required\": [\"city\"]}}}\n\
            </tools><|im_end|>\n<|im_start|>user\nweather in Paris?<|im_end|>\n<|im_start|>assistant\n";
        assert_eq!(out, expected);
        // Without tools the `tools` variable is undefined, so the template takes the other branch.
        let out = t.render(&msgs, &[], false).unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nweather in Paris?<|im_end|>\n"
        );
    }

    #[test]
    fn a_template_without_tools_gets_them_declared_in_the_system_message() {
        const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}";
        let t = ChatTemplate::new(CHATML, "", "<|im_end|>").unwrap();
        assert!(!t.declares_tools());
        assert!(ChatTemplate::new(CHATML_TOOLS, "", "")
            .unwrap()
            .declares_tools());
        let tool = normalize_tool(r#"{"name":"get_time","parameters":{"type":"object"}}"#).unwrap();
        let block = tool_block(std::slice::from_ref(&tool));
        assert!(
            block.contains(&format!("<tools>\n{tool}\n</tools>")),
            "{block}"
        );
        assert!(
            block.contains("<tool_call>") && block.contains("</tool_call>"),
            "{block}"
        );
        let user = ChatMessage::new(Role::User, "time?");
        // After the system text, or as a system message of its own.
        let out = t
            .render(
                &[ChatMessage::new(Role::System, "Be brief."), user.clone()],
                std::slice::from_ref(&tool),
                false,
            )
            .unwrap();
        assert_eq!(
            out,
            format!("<|im_start|>system\nBe brief.\n\n{block}<|im_end|>\n<|im_start|>user\ntime?<|im_end|>\n")
        );
        let out = t
            .render(std::slice::from_ref(&user), &[tool], false)
            .unwrap();
        assert_eq!(
            out,
            format!("<|im_start|>system\n{block}<|im_end|>\n<|im_start|>user\ntime?<|im_end|>\n")
        );
        // No tools: the messages as they are.
        let out = t.render(&[user], &[], false).unwrap();
        assert_eq!(out, "<|im_start|>user\ntime?<|im_end|>\n");
    }

    #[test]
    fn whether_a_template_writes_tools_out_is_asked_of_the_template() {
        // Reads `tools` through a `set` (minijinja's list of undeclared
        // variables misses it): it writes them out itself.
        const SET_TOOLS: &str =
            "{% set tools = tools or [] %}{% for t in tools %}[{{ t.function.name }}]{% endfor %}\
            {% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}";
        let t = ChatTemplate::new(SET_TOOLS, "", "").unwrap();
        assert!(t.declares_tools());
        let tool = normalize_tool(r#"{"name":"get_time"}"#).unwrap();
        let out = t
            .render(
                &[ChatMessage::new(Role::User, "hi")],
                std::slice::from_ref(&tool),
                false,
            )
            .unwrap();
        assert_eq!(
            out, "[get_time]user: hi\n",
            "declared once, by the template"
        );
        // Refuses a system message (Gemma's way): the block opens the first
        // message instead.
        const NO_SYSTEM: &str = "{% for m in messages %}{% if m.role == 'system' %}\
            {{ raise_exception('System role not supported') }}{% endif %}\
            <{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}";
        let t = ChatTemplate::new(NO_SYSTEM, "", "").unwrap();
        assert!(!t.declares_tools());
        let block = tool_block(std::slice::from_ref(&tool));
        let out = t
            .render(&[ChatMessage::new(Role::User, "hi")], &[tool], false)
            .unwrap();
        assert_eq!(out, format!("<user>{block}\n\nhi</user>"));
    }

    #[test]
    fn helpers_and_globals() {
        let src = "{{ bos_token }}|{{ eos_token }}|{{ strftime_now('%Y') | length }}|\
                   {{ messages[0].content.startswith('he') }}|{{ {'b': 1, 'a': [1, 'é']} | tojson }}|\
                   {{ {'a': 1} | tojson(indent=2) }}";
        let t = ChatTemplate::new(src, "<s>", "</s>").unwrap();
        let out = t
            .render(&[ChatMessage::new(Role::User, "hello")], &[], false)
            .unwrap();
        assert_eq!(
            out,
            "<s>|</s>|4|True|{\"b\": 1, \"a\": [1, \"é\"]}|{\n  \"a\": 1\n}"
        );
        let t = ChatTemplate::new("{{ raise_exception('no system role') }}", "", "").unwrap();
        let err = t.render(&[], &[], false).unwrap_err();
        assert!(err.to_string().contains("no system role"), "{err}");
        assert!(matches!(
            ChatTemplate::new("{% for %}", "", ""),
            Err(EngineError::TemplateSyntax(_))
        ));
        let t = ChatTemplate::new("{{ messages[0].role }}", "", "").unwrap();
        let roles: Vec<_> = Role::ALL
            .iter()
            .map(|&r| t.render(&[ChatMessage::new(r, "x")], &[], false).unwrap())
            .collect();
        assert_eq!(roles, ["system", "user", "assistant", "tool"]);
    }

    #[test]
    fn normalize_tool_accepts_three_shapes() {
        let expected = json!({"type": "function", "function": {
            "name": "f", "description": "d",
            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}});
        let params = r#"{"type":"object","properties":{"x":{"type":"integer"}}}"#;
        let openai = format!(
            r#"{{"type":"function","function":{{"name":"f","description":"d","parameters":{params}}}}}"#
        );
        let bare = format!(r#"{{"name":"f","description":"d","parameters":{params}}}"#);
        let anthropic = format!(r#"{{"name":"f","description":"d","input_schema":{params}}}"#);
        for src in [&openai, &bare, &anthropic] {
            assert_eq!(normalize_tool(src).unwrap(), expected, "{src}");
        }
        // No parameters: the empty object schema; no description: left out.
        assert_eq!(
            normalize_tool(r#"{"name":"ping"}"#).unwrap(),
            json!({"type": "function", "function": {"name": "ping",
                "parameters": {"type": "object", "properties": {}}}})
        );
    }

    #[test]
    fn normalize_tool_rejects_bad_input() {
        for bad in [
            "not json",
            "[1, 2]",
            "42",
            r#"{"description":"no name"}"#,
            r#"{"name": 5}"#,
            r#"{"name": ""}"#,
            r#"{"type":"function"}"#,
            r#"{"type":"function","function":{"description":"x"}}"#,
            r#"{"type":"web_search","name":"ws"}"#,
            r#"{"name":"f","parameters":"nope"}"#,
            r#"{"name":"f","description":7}"#,
        ] {
            let err = normalize_tool(bad).unwrap_err();
            assert!(matches!(err, EngineError::InvalidTool(_)), "{bad}: {err}");
        }
    }
}
