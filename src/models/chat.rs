//! Chat prompts: the checkpoint's Jinja chat template rendered with
//! `minijinja` ([`ChatTemplate`]), split into the template's own text and
//! the messages' text ([`ChatTemplate::render_segments`]) so that control
//! tokens come from the template only; and fixed ChatML helpers
//! ([`chatml_prompt`], SmolLM2-Instruct's [`smollm2_chat_prompt`]) for code
//! that needs ChatML without a checkpoint. Tokenising is
//! [`super::tokenizer`]'s job; this module imports nothing of the crate.

use candle_core::{bail, Error, Result};
use minijinja::{context, Environment, ErrorKind};
use serde::Serialize;

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

/// Days since 1970-01-01 to (year, month 1..=12, day 1..=31), proleptic
/// Gregorian (H. Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// (year, month 1..=12, day) to days since 1970-01-01 (H. Hinnant's
/// `days_from_civil`).
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = i64::from((m + 9) % 12);
    let doy = (153 * mp + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// Formats `unix_seconds` (UTC) with the strftime directives chat templates
/// use: `%Y %m %d %e %B %b %A %a %H %M %S %j %%`.
fn strftime(format: &str, unix_seconds: i64) -> std::result::Result<String, minijinja::Error> {
    let days = unix_seconds.div_euclid(86_400);
    let secs = unix_seconds.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    let day_of_year = days - days_from_civil(y, 1, 1) + 1;
    // 1970-01-01 was a Thursday (index 3, Monday = 0).
    let weekday = (days + 3).rem_euclid(7) as usize;
    // m is in 1..=12 (civil_from_days); weekday is in 0..7 (rem_euclid);
    // the month and weekday names are ASCII, so [..3] cuts at a character.
    let month = MONTHS[(m - 1) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('e') => out.push_str(&format!("{d:>2}")),
            Some('B') => out.push_str(month),
            Some('b') => out.push_str(&month[..3]),
            Some('A') => out.push_str(WEEKDAYS[weekday]),
            Some('a') => out.push_str(&WEEKDAYS[weekday][..3]),
            Some('H') => out.push_str(&format!("{:02}", secs / 3600)),
            Some('M') => out.push_str(&format!("{:02}", secs / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", secs % 60)),
            Some('j') => out.push_str(&format!("{day_of_year:03}")),
            Some('%') => out.push('%'),
            other => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now: unsupported directive %{}",
                        other.map(String::from).unwrap_or_default()
                    ),
                ))
            }
        }
    }
    Ok(out)
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
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
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
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| Error::msg(format!("{OP}: parsing the template: {e:#}")))?;
        Ok(Self {
            env,
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        })
    }

    /// Renders `messages`, ending with the assistant's turn opening when
    /// `add_generation_prompt`.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let template = self
            .env
            .get_template("chat")
            .map_err(|e| Error::msg(format!("{OP}: {e:#}")))?;
        template
            .render(context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
            })
            .map_err(|e| {
                Error::msg(format!(
                    "{OP}: rendering {} messages: {e:#}",
                    messages.len()
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
