//! Chat prompts: the checkpoint's Jinja chat template rendered with
//! `minijinja` ([`ChatTemplate`]), split into the template's own text and
//! the messages' text ([`ChatTemplate::render_segments`]) so that control
//! tokens come from the template only; and fixed ChatML helpers
//! ([`chatml_prompt`], SmolLM2-Instruct's [`smollm2_chat_prompt`]) for code
//! that needs ChatML without a checkpoint. Tokenising is
//! [`super::tokenizer`]'s job; this module imports nothing of the crate.

use std::sync::atomic::AtomicUsize;
use std::sync::Arc;

use candle_core::{bail, Error, Result};
use minijinja::value::{Rest, Value, ValueKind};
use minijinja::{context, Environment, ErrorKind, State};
use serde::Serialize;

mod bounds;
mod strftime;

use bounds::{
    binop_estimate, budget, builtin_filters, filter_estimate, guarded_source, method_estimate,
    size, BoundedWriter, Budget, GUARD,
};
pub use bounds::{
    MAX_OUTPUT_BASE_BYTES, MAX_TEMPLATE_BYTES, OUTPUT_BYTES_PER_MESSAGE_BYTE,
    RENDER_BUDGET_BASE_BYTES, RENDER_BUDGET_PER_MESSAGE_BYTE, TEMPLATE_FUEL,
    TEMPLATE_RECURSION_LIMIT,
};
use strftime::strftime;

const OP: &str = "chat-template";

/// SmolLM2-Instruct's default system prompt, inserted by its chat template
/// when the conversation does not start with a system message.
pub const SMOLLM2_SYSTEM_PROMPT: &str =
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face";

/// One message of a conversation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The text.
    pub content: String,
}

impl ChatMessage {
    /// A message from `role`.
    pub fn new(role: &str, content: &str) -> Self {
        Self {
            role: role.to_string(),
            content: content.to_string(),
        }
    }
}

/// A piece of a rendered chat prompt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PromptSegment {
    /// Text the template wrote (`<|im_start|>user\n`): its control-token
    /// markers are the model's control tokens.
    Template(String),
    /// Text of a message, as the template inserted it (possibly trimmed):
    /// to be encoded as plain text, whatever markers it writes.
    Message(String),
}

/// The marker standing for message `k` in the probe rendering of
/// [`ChatTemplate::render_segments`]: Unicode noncharacters, which no text
/// is expected to contain (a message that does is refused).
fn placeholder(k: usize) -> String {
    format!("\u{FDD0}{k}\u{FDD1}")
}

/// A checkpoint's chat template (Hugging Face's Jinja format: a
/// `messages` list of `{role, content}`, `add_generation_prompt`,
/// `bos_token`, `eos_token`), rendered with `minijinja` as `transformers`
/// renders it: `trim_blocks` and `lstrip_blocks` on, Python string and dict
/// methods (`.strip()`, `.startswith()`, `.items()`, ...), and the
/// `raise_exception(message)` and `strftime_now(format)` functions (UTC).
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// Parses `source`; `bos_token` and `eos_token` are the texts the
    /// template may write for them (`<bos>`, `<|im_end|>`).
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self> {
        let guarded = guarded_source(source)?;
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.set_recursion_limit(TEMPLATE_RECURSION_LIMIT);
        env.set_unknown_method_callback(|state, value, method, args| {
            let budget = budget(state)?;
            let est = method_estimate(value, method, args, budget.left());
            budget.charge(&format!("method {method}"), est)?;
            minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
        });
        for (name, filter) in builtin_filters() {
            env.add_filter(
                name,
                move |state: &State,
                      args: Rest<Value>|
                      -> std::result::Result<Value, minijinja::Error> {
                    let budget = budget(state)?;
                    let est = filter_estimate(name, &args, budget.left());
                    budget.charge(&format!("filter {name}"), est)?;
                    filter.call(state, &args)
                },
            );
        }
        // The operators' own semantics, run once the guard has charged them.
        let ops = Arc::new(Environment::new());
        env.add_function(
            format!("{GUARD}binop"),
            move |state: &State,
                  op: String,
                  a: Value,
                  b: Value|
                  -> std::result::Result<Value, minijinja::Error> {
                let budget = budget(state)?;
                let est = binop_estimate(&op, &a, &b, budget.left());
                budget.charge(&format!("`{op}`"), est)?;
                let expr = match op.as_str() {
                    "+" => "a + b",
                    "*" => "a * b",
                    "~" => "a ~ b",
                    "%" => "a % b",
                    _ => {
                        return Err(minijinja::Error::new(
                            ErrorKind::InvalidOperation,
                            format!("no guarded operator {op}"),
                        ))
                    }
                };
                ops.compile_expression(expr)?
                    .eval(context! { a => a, b => b })
            },
        );
        env.add_function(
            format!("{GUARD}emit"),
            |state: &State, v: Value| -> std::result::Result<Value, minijinja::Error> {
                let budget = budget(state)?;
                let n = size(&v, budget.left());
                let est = if v.kind() == ValueKind::String {
                    n
                } else {
                    n.saturating_mul(4).saturating_add(8)
                };
                budget.charge("an emitted value", est)?;
                Ok(v)
            },
        );
        env.add_function(
            format!("{GUARD}iter"),
            |state: &State, v: Value, raw: usize| -> std::result::Result<Value, minijinja::Error> {
                let budget = budget(state)?;
                let items = size(&v, budget.left());
                budget.charge("a loop", items.saturating_mul(raw.max(1)))?;
                Ok(v)
            },
        );
        env.add_function(
            "debug",
            || -> std::result::Result<Value, minijinja::Error> {
                Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    "debug() is not available in chat templates",
                ))
            },
        );
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_function("strftime_now", |format: String| {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs() as i64);
            strftime(&format, now)
        });
        env.add_template_owned("chat", guarded)
            .map_err(|e| Error::msg(format!("{OP}: parsing the template: {e:#}")))?;
        Ok(Self {
            env,
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        })
    }

    /// Renders `messages`, ending with the assistant's turn opening when
    /// `add_generation_prompt`.
    ///
    /// The rendering is bounded (see [`TEMPLATE_FUEL`],
    /// [`TEMPLATE_RECURSION_LIMIT`], [`MAX_OUTPUT_BASE_BYTES`] and
    /// [`RENDER_BUDGET_BASE_BYTES`]): a template that passes a bound is an
    /// error naming it.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let template = self
            .env
            .get_template("chat")
            .map_err(|e| Error::msg(format!("{OP}: {e:#}")))?;
        let message_bytes = messages.iter().fold(0usize, |t, m| {
            t.saturating_add(m.role.len() + m.content.len())
        });
        let budget = Arc::new(Budget {
            limit: RENDER_BUDGET_BASE_BYTES
                .saturating_add(message_bytes.saturating_mul(RENDER_BUDGET_PER_MESSAGE_BYTE)),
            used: AtomicUsize::new(0),
        });
        let mut out = BoundedWriter {
            buf: Vec::new(),
            max: MAX_OUTPUT_BASE_BYTES
                .saturating_add(message_bytes.saturating_mul(OUTPUT_BYTES_PER_MESSAGE_BYTE)),
            overflowed: false,
        };
        let rendered = template.render_captured_to(
            context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
                __cpa_guard_budget => Value::from_dyn_object(budget),
            },
            &mut out,
        );
        let n = messages.len();
        match rendered {
            Ok(_) => {}
            Err(_) if out.overflowed => bail!(
                "{OP}: rendering {n} messages: the output passed its bound of {} bytes",
                out.max
            ),
            Err(e) if e.kind() == ErrorKind::OutOfFuel => bail!(
                "{OP}: rendering {n} messages: the template ran more than {TEMPLATE_FUEL} instructions (out of fuel)"
            ),
            Err(e) => bail!("{OP}: rendering {n} messages: {e:#}"),
        }
        String::from_utf8(out.buf).map_err(|e| {
            Error::msg(format!(
                "{OP}: rendering {n} messages: the output is not UTF-8: {e}"
            ))
        })
    }

    /// Renders `messages` as [`render`](Self::render) does, split into the
    /// template's text and the messages' text, so that markers written in a
    /// message can be encoded as plain text.
    ///
    /// The template is rendered twice: with the messages, and with each
    /// message's content replaced by a placeholder. The placeholders split
    /// the second rendering into the template's pieces; the first rendering
    /// must be those pieces with each message's content in place of its
    /// placeholder, as written or trimmed (templates `| trim` the content).
    /// A template that rewrites content otherwise, or whose output depends
    /// on it, cannot be split and is an error naming the message.
    pub fn render_segments(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<PromptSegment>> {
        if let Some(k) = messages
            .iter()
            .position(|m| m.content.contains(['\u{FDD0}', '\u{FDD1}']))
        {
            bail!("{OP}: message {k} contains the noncharacter U+FDD0 or U+FDD1, which marks message text while rendering");
        }
        let full = self.render(messages, add_generation_prompt)?;
        let probe: Vec<ChatMessage> = messages
            .iter()
            .enumerate()
            .map(|(k, m)| ChatMessage {
                role: m.role.clone(),
                content: placeholder(k),
            })
            .collect();
        let masked = self.render(&probe, add_generation_prompt)?;
        // The probe's pieces: template text, then (message, template text)...
        enum Piece<'a> {
            Text(&'a str),
            Message(usize),
        }
        let mut pieces = Vec::new();
        let mut rest = masked.as_str();
        // `find` gives the byte offset of a marker present in the string, so
        // the offsets past it (`start + len_utf8`, `end + len_utf8`) are
        // character boundaries within it: the slices cannot panic.
        while let Some(start) = rest.find('\u{FDD0}') {
            pieces.push(Piece::Text(&rest[..start]));
            let after = &rest[start + '\u{FDD0}'.len_utf8()..];
            let Some(end) = after.find('\u{FDD1}') else {
                bail!("{OP}: the template cut a message placeholder apart");
            };
            let k: usize = match after[..end].parse() {
                Ok(k) if k < messages.len() => k,
                _ => bail!("{OP}: the template rewrote a message placeholder"),
            };
            pieces.push(Piece::Message(k));
            rest = &after[end + '\u{FDD1}'.len_utf8()..];
        }
        pieces.push(Piece::Text(rest));
        let mut segments = Vec::new();
        // `pos` only moves past text of `full` that was matched, so it stays
        // a character boundary of `full`, at most its length.
        let mut pos = 0;
        for (i, piece) in pieces.iter().enumerate() {
            match *piece {
                Piece::Text(t) => {
                    if !full[pos..].starts_with(t) {
                        bail!("{OP}: the template writes different text around the messages than around placeholders; it cannot be split into template and message text");
                    }
                    match segments.last_mut() {
                        // After an empty message: one piece of template text.
                        Some(PromptSegment::Template(prev)) => prev.push_str(t),
                        _ if t.is_empty() => {}
                        _ => segments.push(PromptSegment::Template(t.to_string())),
                    }
                    pos += t.len();
                }
                Piece::Message(k) => {
                    let c = messages[k].content.as_str();
                    // Pieces alternate text and messages, text first and last.
                    let next = match pieces.get(i + 1) {
                        Some(Piece::Text(t)) => *t,
                        _ => bail!(
                            "{OP}: the template wrote two placeholders without text between them"
                        ),
                    };
                    let is_final = i + 2 == pieces.len();
                    let fits = |cand: &str| {
                        let after = pos + cand.len();
                        full[pos..].starts_with(cand)
                            && if is_final {
                                full.get(after..) == Some(next)
                            } else {
                                full.get(after..).is_some_and(|r| r.starts_with(next))
                            }
                    };
                    let Some(cand) = [c, c.trim(), c.trim_start(), c.trim_end()]
                        .into_iter()
                        .find(|cand| fits(cand))
                    else {
                        bail!("{OP}: the template rewrites the text of message {k} (role {}) beyond trimming it; it cannot be split into template and message text", messages[k].role);
                    };
                    if !cand.is_empty() {
                        segments.push(PromptSegment::Message(cand.to_string()));
                    }
                    pos += cand.len();
                }
            }
        }
        if pos != full.len() {
            bail!("{OP}: the rendered prompt is longer than its template and message pieces; it cannot be split");
        }
        Ok(segments)
    }
}

/// The concatenated text of `segments`: the rendered prompt.
pub fn segments_text(segments: &[PromptSegment]) -> String {
    segments
        .iter()
        .map(|s| match s {
            PromptSegment::Template(t) | PromptSegment::Message(t) => t.as_str(),
        })
        .collect()
}

/// Formats a conversation as ChatML:
/// `<|im_start|>{role}\n{content}<|im_end|>\n` per message, with
/// `default_system` first when the first message is not a system message,
/// and `<|im_start|>assistant\n` at the end when `add_generation_prompt`.
/// With `default_system = Some(SMOLLM2_SYSTEM_PROMPT)` this is
/// SmolLM2-Instruct's chat template.
pub fn chatml_prompt(
    messages: &[ChatMessage],
    default_system: Option<&str>,
    add_generation_prompt: bool,
) -> String {
    let mut out = String::new();
    let starts_with_system = messages.first().is_some_and(|m| m.role == "system");
    if let (false, Some(system)) = (starts_with_system, default_system) {
        out.push_str(&format!("<|im_start|>system\n{system}<|im_end|>\n"));
    }
    for m in messages {
        out.push_str(&format!(
            "<|im_start|>{}\n{}<|im_end|>\n",
            m.role, m.content
        ));
    }
    if add_generation_prompt {
        out.push_str("<|im_start|>assistant\n");
    }
    out
}

/// SmolLM2-Instruct's prompt for one user message.
pub fn smollm2_chat_prompt(user: &str) -> String {
    chatml_prompt(
        &[ChatMessage::new("user", user)],
        Some(SMOLLM2_SYSTEM_PROMPT),
        true,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SmolLM2-Instruct's `tokenizer.chat_template`.
    const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn smollm2_template_is_chatml_with_default_system() {
        assert_eq!(
            smollm2_chat_prompt("Hi"),
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
             <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        let own_system = chatml_prompt(
            &[
                ChatMessage::new("system", "S"),
                ChatMessage::new("user", "U"),
            ],
            Some(SMOLLM2_SYSTEM_PROMPT),
            false,
        );
        assert_eq!(
            own_system,
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
        );
        let t = ChatTemplate::new(SMOLLM2, "<|im_start|>", "<|im_end|>").unwrap();
        for (messages, gen) in [
            (vec![ChatMessage::new("user", "Hi")], true),
            (
                vec![
                    ChatMessage::new("system", "S"),
                    ChatMessage::new("user", "U"),
                ],
                false,
            ),
        ] {
            assert_eq!(
                t.render(&messages, gen).unwrap(),
                chatml_prompt(&messages, Some(SMOLLM2_SYSTEM_PROMPT), gen)
            );
        }
    }

    #[test]
    fn segments_separate_template_and_message_text() {
        let t = ChatTemplate::new(SMOLLM2, "<|im_start|>", "<|im_end|>").unwrap();
        let messages = [
            ChatMessage::new("system", "<|im_end|>"),
            ChatMessage::new("user", ""),
        ];
        let segments = t.render_segments(&messages, true).unwrap();
        assert_eq!(
            segments,
            [
                PromptSegment::Template("<|im_start|>system\n".into()),
                PromptSegment::Message("<|im_end|>".into()),
                PromptSegment::Template(
                    "<|im_end|>\n<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n".into()
                ),
            ]
        );
        assert_eq!(segments_text(&segments), t.render(&messages, true).unwrap());
    }

    #[test]
    fn trimmed_content_is_found_and_rewritten_content_is_refused() {
        let trim = ChatTemplate::new(
            "{{ bos_token }}{% for m in messages %}<turn>{{ m.content | trim }}</turn>\n{% endfor %}",
            "<bos>",
            "<eos>",
        )
        .unwrap();
        let segments = trim
            .render_segments(&[ChatMessage::new("user", "  hi  ")], false)
            .unwrap();
        assert_eq!(
            segments,
            [
                PromptSegment::Template("<bos><turn>".into()),
                PromptSegment::Message("hi".into()),
                PromptSegment::Template("</turn>\n".into()),
            ]
        );
        let upper = ChatTemplate::new(
            "{% for m in messages %}[{{ m.content | upper }}]{% endfor %}",
            "",
            "",
        )
        .unwrap();
        let err = upper
            .render_segments(&[ChatMessage::new("user", "hi")], false)
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("chat-template: the template rewrites the text of message 0 (role user) beyond trimming it; it cannot be split into template and message text"),
            "{err}"
        );
        let err = trim
            .render_segments(&[ChatMessage::new("user", "a\u{FDD0}")], false)
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("chat-template: message 0 contains the noncharacter U+FDD0 or U+FDD1"),
            "{err}"
        );
    }

    #[test]
    fn hugging_face_template_helpers() {
        // Python string methods, raise_exception and strftime_now.
        let t = ChatTemplate::new(
            "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation roles must start with user') }}{% endif %}{{ messages[0]['content'].strip().upper() }}{{ strftime_now('%Y') | length }}",
            "",
            "",
        )
        .unwrap();
        assert_eq!(
            t.render(&[ChatMessage::new("user", "  hi ")], false)
                .unwrap(),
            "HI4"
        );
        let err = t
            .render(&[ChatMessage::new("assistant", "x")], false)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("Conversation roles must start with user"),
            "{err}"
        );
        let err = ChatTemplate::new("{% for %}", "", "")
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("chat-template: parsing the template: "),
            "{err}"
        );
    }

    /// Renders `source` with one message, asserting it ends within 2 s.
    fn render_bounded(source: &str) -> Result<String> {
        let start = std::time::Instant::now();
        let r = ChatTemplate::new(source, "<s>", "</s>")
            .and_then(|t| t.render(&[ChatMessage::new("user", "hi")], true));
        let took = start.elapsed();
        assert!(
            took < std::time::Duration::from_secs(2),
            "{source}: {took:?}"
        );
        r
    }

    /// The error's first line (no backtrace).
    fn first_line(e: Error) -> String {
        e.to_string().lines().next().unwrap_or_default().to_string()
    }

    #[test]
    fn hostile_templates_end_in_an_error_naming_the_bound() {
        let budget = "would pass the budget of";
        for (source, want) in [
            (
                "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
                "out of fuel",
            ),
            (
                "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
                budget,
            ),
            (
                "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
                budget,
            ),
            ("{% for c in 'x' * 100000000 %}{{ c }}{% endfor %}", budget),
            ("{{ ('x' * 99999999) ~ ('x' * 99999999) }}", budget),
            ("{% set a = 'xxxxxxxxxxxxxxxx' %}{% set b = a~a~a~a %}{% set c = b~b~b~b %}{% set d = c~c~c~c %}{% set e = d~d~d~d %}{% set f = e~e~e~e %}{% set g = f~f~f~f %}{% set h = g~g~g~g %}{% set i = h~h~h~h %}{% set j = i~i~i~i %}{% set k = j~j~j~j %}{{ k | length }}", budget),
            ("{% set ns = namespace(l=[1]) %}{% for i in range(64) %}{% set ns.l = [ns.l, ns.l] %}{% endfor %}{{ ns.l ~ '' }}", budget),
            ("{% set ns = namespace(l=[1]) %}{% for i in range(64) %}{% set ns.l = [ns.l, ns.l] %}{% endfor %}{% set x %}{{ ns.l }}{% endset %}", budget),
            ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set x %}{{ ns.s }}{{ ns.s }}{% endset %}{% set ns.s = x %}{% endfor %}", budget),
            ("{{ 'x' | indent(1000000000000) }}", budget),
            ("{{ '%1000000000000s' % 'x' }}", budget),
            ("{{ '{:>1000000000000}'.format('x') }}", budget),
            ("{{ ('x' * 1000) | replace('', 'y' * 100000) }}", budget),
            ("{{ ([1] * 100000000) | list | length }}", budget),
            ("{% macro m(n) %}{{ m(n + 1) }}{% endmacro %}{{ m(0) }}", "recursion"),
            ("{% for i in range(100000) %}{% for j in range(100) %}{% endfor %}{% endfor %}", "out of fuel"),
            ("{% for i in range(100000) %}{% for j in range(30) %}{% set x = i + j %}{% endfor %}{% endfor %}", "out of fuel"),
        ] {
            let err = match render_bounded(source) {
                Ok(out) => panic!("{source} rendered {} bytes", out.len()),
                Err(e) => first_line(e),
            };
            assert!(err.starts_with("chat-template: rendering 1 messages: "), "{source}: {err}");
            assert!(err.contains(want), "{source}: {err}");
        }
        // A `set` in a loop body is the body's own: `s` does not double.
        assert_eq!(
            render_bounded(
                "{% set s = 'x' %}{% for i in range(64) %}{% set s = s ~ s %}{% endfor %}{{ s | length }}"
            )
            .unwrap(),
            "1"
        );
        // Output past the bound, rendering within the budget.
        let err = first_line(
            render_bounded("{% for i in range(3000) %}{{ 'y' * 1000 }}{% endfor %}").unwrap_err(),
        );
        assert_eq!(
            err,
            format!(
                "chat-template: rendering 1 messages: the output passed its bound of {} bytes",
                MAX_OUTPUT_BASE_BYTES + 6 * OUTPUT_BYTES_PER_MESSAGE_BYTE
            )
        );
        let err = first_line(ChatTemplate::new("{{ __cpa_guard_emit(1) }}", "", "").unwrap_err());
        assert_eq!(
            err,
            "chat-template: the template writes __cpa_guard_, a name reserved for the renderer's guards"
        );
    }

    #[test]
    fn guarded_operators_keep_their_meaning() {
        let t = "{{ 1 + 2 }}|{{ 'a' + 'b' }}|{{ ('a' ~ 1) ~ (2 * 3) }}|{{ 'x' * 3 }}|{{ [1] + [2] }}|{{ ([1, 2] * 2) | list }}|{{ 7 % 3 }}|{{ (messages[0].content ~ '!') | upper }}|{{ ((1 + 2)) * 3 }}|{{ -1 + 1 }}|{% for x in (messages | map(attribute='role')) + ['z'] %}{{ x }}{% endfor %}|{{ 2 ** 3 }}|{{ 1.5 + 1 }}|{{ 'a' if 1 + 1 == 2 else 'b' }}";
        assert_eq!(
            render_bounded(t).unwrap(),
            "3|ab|a16|xxx|[1, 2]|[1, 2, 1, 2]|1|HI!|9|0|userz|8|2.5|a"
        );
        // A long real message renders: the bounds grow with the messages.
        let t = ChatTemplate::new(SMOLLM2, "", "").unwrap();
        let long = "word ".repeat(400_000);
        let out = t.render(&[ChatMessage::new("user", &long)], true).unwrap();
        assert!(out.contains(&long));
    }

    #[test]
    fn strftime_formats_utc_dates() {
        assert_eq!(
            strftime("%d %b %Y %A %j %H:%M:%S %%", 0).unwrap(),
            "01 Jan 1970 Thursday 001 00:00:00 %"
        );
        // 2024-02-29 13:05:09 UTC, a leap day.
        assert_eq!(
            strftime("%Y-%m-%d %e %B %a %j %H:%M:%S", 1_709_211_909).unwrap(),
            "2024-02-29 29 February Thu 060 13:05:09"
        );
        assert_eq!(strftime("%d %b %Y", 1_735_689_600).unwrap(), "01 Jan 2025");
        let err = strftime("%Q", 0).unwrap_err().to_string();
        assert!(
            err.contains("strftime_now: unsupported directive %Q"),
            "{err}"
        );
    }
}
