//! Text in and out: a `tokenizers` tokenizer plus the model's Jinja chat template.
//!
//! Chat templates are rendered with minijinja the way transformers renders them
//! (`trim_blocks`, `lstrip_blocks`, Python string methods, `raise_exception`, and `tojson` as
//! transformers defines it: Python's `json.dumps` with its `", "` / `": "` separators, keys in
//! their order, nothing HTML-escaped, `indent=` supported), with the
//! variables Hugging Face passes: `messages`, `add_generation_prompt`, `bos_token`,
//! `eos_token`, and `tools` (the JSON schemas of the tools the model may call, which templates
//! with tool support render into the system prompt; absent = `None`, as transformers passes
//! `tools=None`).

use std::path::Path;

use candle_core::{Result, bail};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// One chat turn, as OpenAI's and transformers' chat formats write it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The text of the turn: empty when the message has none (`null`, or no `content` key:
    /// an assistant turn of tool calls only, as OpenAI's format and gpt-oss's datasets write it).
    #[serde(default, deserialize_with = "null_as_empty")]
    pub content: String,
    /// An assistant turn's tool calls (transformers' `tool_calls`: templates with tool support
    /// render them). A multi-turn episode keeps the model's turn as the text it sampled
    /// instead, its calls written in it, so this stays `None` there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
    /// A `tool` message's answer to the call of this id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// A `tool` message's tool name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Any other keys the template may read, as a dataset's messages carry them (e.g.
    /// `reasoning_content`, or `tool_calls` in the dataset's own shape).
    #[serde(flatten, default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub extra: serde_json::Map<String, Value>,
}

/// A string, with `null` read as empty.
fn null_as_empty<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<String, D::Error> {
    Ok(Option::<String>::deserialize(d)?.unwrap_or_default())
}

impl ChatMessage {
    /// A turn with the given role.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
            name: None,
            extra: serde_json::Map::new(),
        }
    }

    /// A `tool` message: what the tool `name` answered.
    pub fn tool(name: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            name: Some(name.into()),
            ..Self::new("tool", content)
        }
    }
}

/// A tool call, as transformers' chat templates read it: `{"type": "function", "function":
/// {"name": ..., "arguments": {...}}}` (the arguments a JSON object, not a string).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    /// The call's id, if the format has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// Always `function`.
    #[serde(rename = "type", default = "function_type")]
    pub kind: String,
    /// The function and its arguments.
    pub function: FunctionCall,
}

fn function_type() -> String {
    "function".into()
}

/// The function of a [`ToolCall`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FunctionCall {
    /// The tool's name.
    pub name: String,
    /// Its arguments (a JSON object).
    pub arguments: Value,
}

impl ToolCall {
    /// A call of `name` with `arguments`.
    pub fn new(name: impl Into<String>, arguments: Value) -> Self {
        Self {
            id: None,
            kind: function_type(),
            function: FunctionCall {
                name: name.into(),
                arguments,
            },
        }
    }
}

/// A tokenizer with its special tokens and chat template.
#[derive(Clone)]
pub struct Tokenizer {
    /// The underlying Hugging Face tokenizer.
    pub inner: tokenizers::Tokenizer,
    /// Jinja chat template, if the model has one.
    pub chat_template: Option<String>,
    /// BOS token text (passed to the template as `bos_token`).
    pub bos_token: Option<String>,
    /// EOS token text (passed to the template as `eos_token`).
    pub eos_token: Option<String>,
    /// Token ids that end generation.
    pub eos_token_ids: Vec<u32>,
    /// Padding id (left padding in batches).
    pub pad_token_id: u32,
    /// Extra variables every chat template rendering sees (TRL's `chat_template_kwargs`,
    /// e.g. `enable_thinking = false` for Qwen3).
    pub chat_template_kwargs: serde_json::Map<String, Value>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.inner.get_vocab_size(true))
            .field("has_chat_template", &self.chat_template.is_some())
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .field("eos_token_ids", &self.eos_token_ids)
            .field("pad_token_id", &self.pad_token_id)
            .field("chat_template_kwargs", &self.chat_template_kwargs)
            .finish()
    }
}

fn err(msg: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::msg(msg.to_string())
}

/// `"<s>"` or `{"content": "<s>", ...}` as transformers writes special tokens.
fn token_text(v: Option<&Value>) -> Option<String> {
    match v {
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Object(o)) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

impl Tokenizer {
    /// Loads `tokenizer.json`, `tokenizer_config.json` (special tokens, `chat_template`) and
    /// `chat_template.jinja` from a Hugging Face model directory. `extra_eos` (from
    /// config.json / generation_config.json) are added to the stop ids.
    pub fn from_hf_dir(dir: &Path, extra_eos: &[u32]) -> Result<Self> {
        let tok_path = dir.join("tokenizer.json");
        let inner = tokenizers::Tokenizer::from_file(&tok_path)
            .map_err(|e| err(format!("{}: {e}", tok_path.display())))?;
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg: Value = if cfg_path.exists() {
            let text = std::fs::read_to_string(&cfg_path)
                .map_err(|e| err(format!("{}: {e}", cfg_path.display())))?;
            serde_json::from_str(&text)
                .map_err(|e| err(format!("{}: invalid JSON: {e}", cfg_path.display())))?
        } else {
            Value::Null
        };
        let mut chat_template = match cfg.get("chat_template") {
            Some(Value::String(s)) => Some(s.clone()),
            Some(Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .or_else(|| list.first())
                .and_then(|t| t.get("template"))
                .and_then(Value::as_str)
                .map(str::to_string),
            _ => None,
        };
        let jinja = dir.join("chat_template.jinja");
        if chat_template.is_none() && jinja.exists() {
            chat_template = Some(
                std::fs::read_to_string(&jinja)
                    .map_err(|e| err(format!("{}: {e}", jinja.display())))?,
            );
        }
        let bos_token = token_text(cfg.get("bos_token"));
        let eos_token = token_text(cfg.get("eos_token"));
        let pad_token = token_text(cfg.get("pad_token"));
        let mut eos_token_ids: Vec<u32> = extra_eos.to_vec();
        if let Some(id) = eos_token.as_deref().and_then(|t| inner.token_to_id(t)) {
            eos_token_ids.push(id);
        }
        eos_token_ids.sort_unstable();
        eos_token_ids.dedup();
        // No padding token: the EOS token, as TRL's trainers pad (the tokenizer's own EOS,
        // before any extra end-of-turn ids).
        let pad_token_id = pad_token
            .as_deref()
            .and_then(|t| inner.token_to_id(t))
            .or_else(|| eos_token.as_deref().and_then(|t| inner.token_to_id(t)))
            .or_else(|| eos_token_ids.first().copied())
            .unwrap_or(0);
        Ok(Self {
            inner,
            chat_template,
            bos_token,
            eos_token,
            eos_token_ids,
            pad_token_id,
            chat_template_kwargs: serde_json::Map::new(),
        })
    }

    /// TRL's `chat_template_path`: takes the chat template of `path` — a Jinja file, or a
    /// Hugging Face model directory, whose template and end-of-turn (EOS) token replace this
    /// tokenizer's as TRL's `clone_chat_template` does: the directory's added tokens that this
    /// vocabulary lacks are added (in id order, with their flags). Returns the ids of the added
    /// tokens: the model's embeddings must then grow to [`Self::vocab_size`] (TRL rounds up to a
    /// multiple of 64 and fills the vocabulary with [`Self::pad_vocab_to`]).
    pub fn set_chat_template_from(&mut self, path: &Path) -> Result<Vec<u32>> {
        if path.is_file() {
            let text = std::fs::read_to_string(path)
                .map_err(|e| err(format!("{}: {e}", path.display())))?;
            ChatTemplate::new(&text, None, None).map_err(|e| {
                err(format!(
                    "{}: not a usable chat template: {e}",
                    path.display()
                ))
            })?;
            self.chat_template = Some(text);
            return Ok(Vec::new());
        }
        if !path.is_dir() {
            return Err(err(format!(
                "{}: no such file or directory",
                path.display()
            )));
        }
        let source = Self::from_hf_dir(path, &[])?;
        let Some(template) = source.chat_template else {
            return Err(err(format!("{}: has no chat template", path.display())));
        };
        let mut missing: Vec<(u32, tokenizers::AddedToken)> = source
            .inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| self.inner.token_to_id(&t.content).is_none())
            .collect();
        missing.sort_by_key(|(id, _)| *id);
        let mut added = Vec::with_capacity(missing.len());
        for (_, t) in missing {
            self.inner.add_tokens(std::slice::from_ref(&t));
            added.extend(self.inner.token_to_id(&t.content));
        }
        if let Some(eos) = &source.eos_token {
            let id = self.inner.token_to_id(eos).ok_or_else(|| {
                err(format!(
                    "{}: its eos token {eos} is not in this model's vocabulary",
                    path.display()
                ))
            })?;
            self.eos_token = Some(eos.clone());
            self.eos_token_ids = vec![id];
        }
        self.chat_template = Some(template);
        Ok(added)
    }

    /// Adds `<extra_id_0>`, `<extra_id_1>`, ... (those not in the vocabulary already) until the
    /// vocabulary has `n` tokens, as TRL's `clone_chat_template` fills the rows it rounded the
    /// embeddings up to. Returns the ids added.
    pub fn pad_vocab_to(&mut self, n: usize) -> Vec<u32> {
        let mut added = Vec::new();
        let mut i = 0;
        while self.vocab_size() < n {
            let t = tokenizers::AddedToken::from(format!("<extra_id_{i}>"), false);
            i += 1;
            if self.inner.add_tokens(std::slice::from_ref(&t)) == 1 {
                added.extend(self.inner.token_to_id(&t.content));
            }
        }
        added
    }

    /// transformers' `apply_chat_template(messages, return_assistant_tokens_mask=True)` (TRL's
    /// `assistant_only_loss`): the conversation rendered and tokenised, each token marked 1
    /// when it carries text of a `{% generation %}` block. `None` when the template has no such
    /// blocks. `tools`: the tool schemas the template renders (none: empty).
    pub fn assistant_tokens_mask(
        &self,
        messages: &[ChatMessage],
        tools: &[Value],
    ) -> Result<Option<(Vec<u32>, Vec<u8>)>> {
        let template = self.compile_chat_template()?;
        if !template.tracks_generation() {
            return Ok(None);
        }
        let (text, spans) = template.render_tracked_with_tools(messages, tools, false)?;
        let enc = self
            .inner
            .encode(text.as_str(), false)
            .map_err(|e| err(format!("tokenizer: {e}")))?;
        let mask = enc
            .get_offsets()
            .iter()
            .map(|&(a, b)| u8::from(spans.iter().any(|r| a < r.end && b > r.start)))
            .collect();
        Ok(Some((enc.get_ids().to_vec(), mask)))
    }

    /// Token ids of `text`; `add_special_tokens` applies the tokenizer's post-processor (BOS).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        Ok(self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| err(format!("tokenizer: {e}")))?
            .get_ids()
            .to_vec())
    }

    /// Text of `ids`; `skip_special_tokens` drops special tokens such as `<|im_end|>`.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| err(format!("tokenizer: {e}")))
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Renders the chat template as transformers' `apply_chat_template(tokenize=False)`.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.compile_chat_template()?
            .render(messages, add_generation_prompt)
    }

    /// [`Self::apply_chat_template`] with `tools` (JSON schemas, transformers'
    /// `apply_chat_template(messages, tools=...)`); an empty list renders as no tools.
    pub fn apply_chat_template_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: &[Value],
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.compile_chat_template()?
            .render_with_tools(messages, tools, add_generation_prompt)
    }

    /// The chat template parsed once, to render many conversations.
    pub fn compile_chat_template(&self) -> Result<ChatTemplate<'_>> {
        let Some(template) = &self.chat_template else {
            bail!(
                "this model has no chat template (tokenizer_config.json `chat_template` or chat_template.jinja)"
            )
        };
        Ok(ChatTemplate::new(
            template,
            self.bos_token.as_deref(),
            self.eos_token.as_deref(),
        )?
        .with_kwargs(&self.chat_template_kwargs))
    }
}

/// Renders a Hugging Face chat template with minijinja.
pub fn render_chat_template(
    template: &str,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    bos_token: Option<&str>,
    eos_token: Option<&str>,
) -> Result<String> {
    ChatTemplate::new(template, bos_token, eos_token)?.render(messages, add_generation_prompt)
}

/// A chat template parsed once, for rendering many conversations (a multi-turn episode renders
/// its conversation after every turn).
pub struct ChatTemplate<'a> {
    env: minijinja::Environment<'a>,
    bos_token: Option<&'a str>,
    eos_token: Option<&'a str>,
    kwargs: Option<&'a serde_json::Map<String, Value>>,
    /// The template marks assistant output with `{% generation %}` blocks.
    tracks_generation: bool,
}

/// Where a `{% generation %}` block's output starts and ends in a rendering (private-use
/// characters, removed before the text is returned).
const GEN_START: char = '\u{E000}';
const GEN_END: char = '\u{E001}';

/// transformers' `{% generation %}` / `{% endgeneration %}` tags (its `AssistantTracker`
/// extension, which TRL's training templates use for `assistant_only_loss`) rewritten as
/// block tags minijinja knows around a marker, so whitespace control (`-`, trim_blocks,
/// lstrip_blocks) applies as it does to the original tags. Returns the source and whether any
/// tag was found.
fn mark_generation_blocks(template: &str) -> (String, bool) {
    static TAG: std::sync::OnceLock<regex::Regex> = std::sync::OnceLock::new();
    let re = TAG.get_or_init(|| {
        regex::Regex::new(r"\{%(-?)\s*(generation|endgeneration)\s*(-?)%\}")
            .expect("a valid pattern")
    });
    if !template.contains("generation") {
        return (template.to_string(), false);
    }
    let mut found = false;
    let out = re.replace_all(template, |c: &regex::Captures<'_>| {
        found = true;
        let marker = if &c[2] == "generation" {
            GEN_START
        } else {
            GEN_END
        };
        format!(
            "{{%{} if true %}}{{{{ \"{}\" }}}}{{% endif {}%}}",
            &c[1], marker, &c[3]
        )
    });
    (out.into_owned(), found)
}

/// The rendering without its generation markers, and the byte ranges (in it) that the
/// `{% generation %}` blocks produced.
fn strip_generation_markers(text: &str) -> (String, Vec<std::ops::Range<usize>>) {
    let mut out = String::with_capacity(text.len());
    let mut spans = Vec::new();
    let mut start = None;
    for ch in text.chars() {
        match ch {
            GEN_START => start = Some(out.len()),
            GEN_END => {
                if let Some(s) = start.take() {
                    spans.push(s..out.len());
                }
            }
            c => out.push(c),
        }
    }
    (out, spans)
}

impl std::fmt::Debug for ChatTemplate<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

impl<'a> ChatTemplate<'a> {
    /// Parses `template` with the settings transformers renders with.
    pub fn new(
        template: &'a str,
        bos_token: Option<&'a str>,
        eos_token: Option<&'a str>,
    ) -> Result<Self> {
        let mut env = minijinja::Environment::new();
        // transformers renders with jinja2's trim_blocks and lstrip_blocks.
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| err(format!("chat template syntax config: {e}")))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_filter("tojson", python_tojson);
        // jinja2's `is iterable` (Python's `iter(x)` succeeds): false for none and undefined,
        // which minijinja iterates as empty. transformers passes `tools=None` without tools,
        // and templates guard `tools | length` with `tools is iterable`.
        env.add_test("iterable", |v: minijinja::Value| {
            !(v.is_none() || v.is_undefined()) && v.try_iter().is_ok()
        });
        env.add_function("strftime_now", |fmt: String| -> String {
            // Templates use this for "today's date" in system prompts; a fixed date keeps
            // prompts, and so caches and tests, reproducible.
            fmt.replace("%Y", "2026")
                .replace("%m", "01")
                .replace("%d", "01")
                .replace("%B", "January")
                .replace("%b", "Jan")
        });
        // jinja2 reads every newline of a template (\r\n, \r) as \n.
        let template = template.replace("\r\n", "\n").replace('\r', "\n");
        let (source, tracks_generation) = mark_generation_blocks(&template);
        env.add_template_owned("chat", source)
            .map_err(|e| err(format!("chat template does not parse: {e}")))?;
        Ok(Self {
            env,
            bos_token,
            eos_token,
            kwargs: None,
            tracks_generation,
        })
    }

    /// Extra template variables (transformers' `apply_chat_template(**kwargs)`); the named
    /// ones (`messages`, `tools`, `add_generation_prompt`, the special tokens) take precedence.
    pub fn with_kwargs(mut self, kwargs: &'a serde_json::Map<String, Value>) -> Self {
        self.kwargs = (!kwargs.is_empty()).then_some(kwargs);
        self
    }

    /// Renders `messages` as transformers' `apply_chat_template(tokenize=False)`.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.render_with_tools(messages, &[], add_generation_prompt)
    }

    /// Whether the template marks assistant output with `{% generation %}` blocks.
    pub fn tracks_generation(&self) -> bool {
        self.tracks_generation
    }

    /// [`Self::render`] with the byte ranges of the text that `{% generation %}` blocks
    /// produced (transformers' `return_assistant_tokens_mask`); empty without such blocks.
    pub fn render_tracked(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<(String, Vec<std::ops::Range<usize>>)> {
        self.render_tracked_with_tools(messages, &[], add_generation_prompt)
    }

    /// [`Self::render_tracked`] with the `tools` variable.
    pub fn render_tracked_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: &[Value],
        add_generation_prompt: bool,
    ) -> Result<(String, Vec<std::ops::Range<usize>>)> {
        Ok(strip_generation_markers(&self.render_marked(
            messages,
            tools,
            add_generation_prompt,
        )?))
    }

    /// [`Self::render`] with the `tools` variable (JSON schemas); an empty list is `None`.
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: &[Value],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let text = self.render_marked(messages, tools, add_generation_prompt)?;
        Ok(match self.tracks_generation {
            true => strip_generation_markers(&text).0,
            false => text,
        })
    }

    /// The rendering, generation markers included.
    fn render_marked(
        &self,
        messages: &[ChatMessage],
        tools: &[Value],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| err(e.to_string()))?;
        let tools = if tools.is_empty() {
            minijinja::Value::from(())
        } else {
            minijinja::Value::from(minijinja::value::Serde(tools))
        };
        let named = minijinja::context! {
            messages => minijinja::Value::from(minijinja::value::Serde(messages)),
            tools => tools,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.unwrap_or(""),
            eos_token => self.eos_token.unwrap_or(""),
        };
        let ctx = match self.kwargs {
            Some(k) => {
                minijinja::context! { ..named, ..minijinja::Value::from(minijinja::value::Serde(k)) }
            }
            None => named,
        };
        tmpl.render(ctx)
            .map_err(|e| err(format!("chat template failed: {e}")))
    }
}

/// transformers' `tojson` filter: `json.dumps(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`, each of those four a keyword a template may set.
fn python_tojson(
    value: minijinja::Value,
    kwargs: minijinja::value::Kwargs,
) -> std::result::Result<minijinja::Value, minijinja::Error> {
    let invalid = |m: String| minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, m);
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let indent: Option<minijinja::Value> = kwargs.get("indent")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    // Python: an int is that many spaces, a string is used as it is, None is no indent.
    let indent = match indent {
        Some(v) if v.is_none() => None,
        Some(v) => Some(match v.as_str() {
            Some(s) => s.to_string(),
            None => " ".repeat(
                usize::try_from(v.clone()).map_err(|_| invalid(format!("tojson: indent {v}")))?,
            ),
        }),
        None => None,
    };
    let (item, key) = match (separators.as_deref(), &indent) {
        (Some([i, k]), _) => (i.clone(), k.clone()),
        (Some(other), _) => return Err(invalid(format!("tojson: separators {other:?}"))),
        (None, Some(_)) => (",".into(), ": ".into()),
        (None, None) => (", ".into(), ": ".into()),
    };
    let mut json = serde_json::to_value(&value).map_err(|e| invalid(format!("tojson: {e}")))?;
    if sort_keys == Some(true) {
        sort_json_keys(&mut json);
    }
    let mut out = Vec::new();
    let f = PythonFormatter {
        item: item.into_bytes(),
        key: key.into_bytes(),
        indent: indent.map(String::into_bytes),
        open: Vec::new(),
    };
    let mut ser = serde_json::Serializer::with_formatter(&mut out, f);
    serde::Serialize::serialize(&json, &mut ser).map_err(|e| invalid(format!("tojson: {e}")))?;
    let mut text = String::from_utf8(out).map_err(|e| invalid(e.to_string()))?;
    if ensure_ascii == Some(true) {
        // Non-ASCII text only occurs inside JSON strings: escape it as Python does.
        text = text
            .chars()
            .flat_map(|c| match c.is_ascii() {
                true => vec![c.to_string()],
                false => {
                    let mut units = [0u16; 2];
                    c.encode_utf16(&mut units)
                        .iter()
                        .map(|u| format!("\\u{u:04x}"))
                        .collect()
                }
            })
            .collect();
    }
    Ok(minijinja::Value::from_safe_string(text))
}

/// Object keys in sorted order, at every depth (Python's `sort_keys=True`).
fn sort_json_keys(v: &mut Value) {
    match v {
        Value::Object(m) => {
            let mut entries: Vec<(String, Value)> = std::mem::take(m).into_iter().collect();
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            for (k, mut x) in entries {
                sort_json_keys(&mut x);
                m.insert(k, x);
            }
        }
        Value::Array(a) => a.iter_mut().for_each(sort_json_keys),
        _ => {}
    }
}

/// Python's `json.dumps` layout: `item` between items, `key` after keys, and with an indent
/// each item on its own line, indented by depth.
struct PythonFormatter {
    item: Vec<u8>,
    key: Vec<u8>,
    indent: Option<Vec<u8>>,
    /// Per open container: whether it has had an item.
    open: Vec<bool>,
}

impl PythonFormatter {
    fn newline<W: ?Sized + std::io::Write>(&self, w: &mut W, depth: usize) -> std::io::Result<()> {
        if let Some(ind) = &self.indent {
            w.write_all(b"\n")?;
            for _ in 0..depth {
                w.write_all(ind)?;
            }
        }
        Ok(())
    }

    fn item<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        if !first {
            w.write_all(&self.item)?;
        }
        if let Some(last) = self.open.last_mut() {
            *last = true;
        }
        self.newline(w, self.open.len())
    }

    fn close<W: ?Sized + std::io::Write>(&mut self, w: &mut W, end: &[u8]) -> std::io::Result<()> {
        if self.open.pop() == Some(true) {
            self.newline(w, self.open.len())?;
        }
        w.write_all(end)
    }
}

impl serde_json::ser::Formatter for PythonFormatter {
    fn begin_array<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.open.push(false);
        w.write_all(b"[")
    }

    fn end_array<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.close(w, b"]")
    }

    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.item(w, first)
    }

    fn begin_object<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.open.push(false);
        w.write_all(b"{")
    }

    fn end_object<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.close(w, b"}")
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.item(w, first)
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(&self.key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

    /// An assistant turn of tool calls only has no `content` (or a null one), as OpenAI's
    /// format writes it: read as empty, its calls and reasoning kept.
    #[test]
    fn messages_without_content_read_as_empty() {
        let m: Vec<ChatMessage> = serde_json::from_str(
            r#"[{"role": "assistant", "thinking": "look it up",
                 "tool_calls": [{"type": "function",
                                 "function": {"name": "f", "arguments": {"x": 1}}}]},
                {"role": "assistant", "content": null}]"#,
        )
        .unwrap();
        assert_eq!(m[0].content, "");
        assert_eq!(m[0].tool_calls.as_ref().unwrap()[0].function.name, "f");
        assert_eq!(m[0].extra["thinking"], "look it up");
        assert_eq!(m[1].content, "");
        // A content of another type is still an error.
        let e = serde_json::from_str::<ChatMessage>(r#"{"role": "user", "content": 3}"#);
        assert!(e.is_err());
    }

    #[test]
    fn chatml_renders_like_transformers() {
        let msgs = [
            ChatMessage::new("system", "Be brief."),
            ChatMessage::new("user", "2+2?"),
        ];
        let s = render_chat_template(CHATML, &msgs, true, None, Some("<|im_end|>")).unwrap();
        assert_eq!(
            s,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    /// `tojson` as Python's `json.dumps` with each keyword transformers' filter takes
    /// (expected strings printed by CPython 3).
    #[test]
    fn tojson_is_pythons_json_dumps() {
        let t = |args: &str| {
            let src = format!("{{{{ x | tojson{args} }}}}");
            let tpl = ChatTemplate::new(&src, None, None).unwrap();
            let x = serde_json::json!({"b": [1, {"z": "é", "a": null}], "a": "ü😀"});
            let mut kw = serde_json::Map::new();
            kw.insert("x".into(), x);
            tpl.with_kwargs(&kw).render(&[], false).unwrap()
        };
        assert_eq!(t(""), r#"{"b": [1, {"z": "é", "a": null}], "a": "ü😀"}"#);
        assert_eq!(
            t("(ensure_ascii=True)"),
            r#"{"b": [1, {"z": "\u00e9", "a": null}], "a": "\u00fc\ud83d\ude00"}"#
        );
        assert_eq!(
            t("(indent=2)"),
            "{\n  \"b\": [\n    1,\n    {\n      \"z\": \"é\",\n      \"a\": null\n    }\n  ],\n  \"a\": \"ü😀\"\n}"
        );
        assert_eq!(
            t("(separators=(',', ':'), sort_keys=True)"),
            r#"{"a":"ü😀","b":[1,{"a":null,"z":"é"}]}"#
        );
        let e = |src: &str| {
            ChatTemplate::new(src, None, None)
                .unwrap()
                .render(&[], false)
                .unwrap()
        };
        assert_eq!(e("{{ [] | tojson(indent=2) }}"), "[]");
        assert_eq!(
            e("{{ {'a': []} | tojson(indent='\t') }}"),
            "{\n\t\"a\": []\n}"
        );
    }

    /// What real templates use beyond the basics, as jinja2 renders it: macros, `loop.nextitem`,
    /// `none is iterable` being false (transformers passes `tools=None`), and \r\n line ends
    /// read as \n. (`scripts/check_chat_templates.py` compares whole model templates.)
    #[test]
    fn macros_adjacent_items_iterable_and_newlines_as_jinja2() {
        let r = |src: &str, tools: &[Value]| {
            let msgs = [
                ChatMessage::new("user", "a"),
                ChatMessage::new("assistant", "b"),
            ];
            ChatTemplate::new(src, None, None)
                .unwrap()
                .render_with_tools(&msgs, tools, false)
                .unwrap()
        };
        assert_eq!(
            r(
                "{% macro f(x) %}[{{ x }}]{% endmacro %}{{ f(messages[0].content) }}",
                &[]
            ),
            "[a]"
        );
        assert_eq!(
            r(
                "{% for m in messages %}{{ m.role }}{% if loop.nextitem is defined %}>{{ loop.nextitem.role }};{% endif %}{% endfor %}",
                &[]
            ),
            "user>assistant;assistant"
        );
        let tools = "{% if tools is iterable and tools | length > 0 %}T{{ tools | length }}{% else %}none{% endif %}";
        assert_eq!(r(tools, &[]), "none");
        assert_eq!(r(tools, &[serde_json::json!({"name": "f"})]), "T1");
        assert_eq!(r("x\r\n{{ messages[1].content }}\ry", &[]), "x\nb\ny");
    }

    #[test]
    fn chat_template_kwargs_reach_the_template_as_transformers_kwargs() {
        // Qwen3's switch, as transformers renders `apply_chat_template(.., enable_thinking=False)`.
        let t = "{{ messages[0]['content'] }}{% if add_generation_prompt %}<a>{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}";
        let msgs = [ChatMessage::new("user", "hi")];
        let mut kw = serde_json::Map::new();
        kw.insert("enable_thinking".into(), Value::Bool(false));
        // A kwarg may not override what the call itself passes.
        kw.insert("add_generation_prompt".into(), Value::Bool(false));
        let plain = ChatTemplate::new(t, None, None).unwrap();
        assert_eq!(plain.render(&msgs, true).unwrap(), "hi<a>");
        let with = ChatTemplate::new(t, None, None).unwrap().with_kwargs(&kw);
        assert_eq!(
            with.render(&msgs, true).unwrap(),
            "hi<a><think>\n\n</think>\n\n"
        );
        assert_eq!(with.render(&msgs, false).unwrap(), "hi");
    }

    #[test]
    fn python_methods_and_raise_exception() {
        let t = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}{{ messages[0]['content'].strip().upper() }}{{ bos_token }}";
        let ok = render_chat_template(
            t,
            &[ChatMessage::new("user", "  hi ")],
            false,
            Some("<s>"),
            None,
        )
        .unwrap();
        assert_eq!(ok, "HI<s>");
        let e = render_chat_template(t, &[ChatMessage::new("system", "x")], false, None, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("first must be user"), "{e}");
    }

    #[test]
    fn trim_and_lstrip_blocks_as_transformers() {
        let t = "{% for m in messages %}\n  {{ m.content }}\n{% endfor %}";
        let s =
            render_chat_template(t, &[ChatMessage::new("user", "a")], false, None, None).unwrap();
        assert_eq!(s, "  a\n");
    }
}
