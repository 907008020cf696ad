//! Per-request text: incremental detokenisation and stop strings, which
//! may span token boundaries.
//!
//! Tokens are decoded in a window ([`IncrementalDecoder`]): each new token's
//! text is the decoding of the tokens from the last complete point on,
//! less the decoding of those before it, so that the cost per token does
//! not grow with the answer (decoding every token from the start, as
//! [`TextStream`](crate::text::tokenizer::TextStream) does, grows as the
//! square of the answer's length), while leading-space rules of the
//! decoder apply as they do to the whole text.
//!
//! Text that could be the start of a stop string is held back until the
//! next tokens show whether it is; when a stop string appears, the text
//! ends just before it (the stop string is not part of the answer).

use candle_core::Result;
use tokenizers::Tokenizer;

use crate::text::tokenizer::decode;

/// Windowed incremental decoding: feeds tokens one by one and yields the
/// text that became final. A token that ends inside a UTF-8 character
/// (byte-level BPE) yields nothing until the character is complete;
/// [`finish`](Self::finish) gives what is left (an incomplete character as
/// U+FFFD, as [`decode`] gives it).
#[derive(Debug, Default)]
pub struct IncrementalDecoder {
    tokens: Vec<u32>,
    /// Where the window starts: the tokens before it are not decoded again.
    prefix: usize,
    /// The tokens whose text has been handed out.
    read: usize,
}

impl IncrementalDecoder {
    /// An empty decoder.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends `token`; returns its text once complete.
    pub fn push(&mut self, tokenizer: &Tokenizer, token: u32) -> Result<Option<String>> {
        self.tokens.push(token);
        self.take(tokenizer, false)
    }

    /// The text not handed out yet, if any.
    pub fn finish(&mut self, tokenizer: &Tokenizer) -> Result<Option<String>> {
        self.take(tokenizer, true)
    }

    fn take(&mut self, tokenizer: &Tokenizer, last: bool) -> Result<Option<String>> {
        let before = decode(tokenizer, &self.tokens[self.prefix..self.read])?;
        let all = decode(tokenizer, &self.tokens[self.prefix..])?;
        if !last && all.ends_with('\u{fffd}') {
            return Ok(None);
        }
        // The window's text extends the text before it; a decoder that
        // rewrites text across tokens may break that, and the text past
        // the length of the earlier text is taken then.
        let new = match all.strip_prefix(before.as_str()) {
            Some(new) => new.to_string(),
            None => all.get(before.len()..).unwrap_or_default().to_string(),
        };
        self.prefix = self.read;
        self.read = self.tokens.len();
        Ok((!new.is_empty()).then_some(new))
    }
}

/// What a token added to the answer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TextDelta {
    /// Text that is final (may be empty).
    pub text: String,
    /// A stop string was found: the answer ends with `text`.
    pub stopped: bool,
}

/// The text of one request's tokens, cut at its first stop string.
#[derive(Debug, Default)]
pub struct Detokenizer {
    stream: IncrementalDecoder,
    stops: Vec<String>,
    /// Decoded text not handed out yet (a possible start of a stop string).
    held: String,
    stopped: bool,
}

impl Detokenizer {
    /// A detokenizer that stops at any of `stops` (empty strings are
    /// ignored).
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            ..Self::default()
        }
    }

    /// True once a stop string was found.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Appends `token`; returns the text that became final and whether a
    /// stop string ended the answer. After a stop, returns nothing.
    pub fn push(&mut self, tokenizer: &Tokenizer, token: u32) -> Result<TextDelta> {
        if self.stopped {
            return Ok(TextDelta::default());
        }
        if let Some(new) = self.stream.push(tokenizer, token)? {
            self.held.push_str(&new);
        }
        Ok(self.release())
    }

    /// Appends text directly (what [`IncrementalDecoder::finish`] gives).
    fn push_text(&mut self, text: &str) -> TextDelta {
        if self.stopped {
            return TextDelta::default();
        }
        self.held.push_str(text);
        self.release()
    }

    /// Ends the answer: the text still held back (an incomplete UTF-8
    /// character's tokens come out as U+FFFD).
    pub fn finish(&mut self, tokenizer: &Tokenizer) -> Result<TextDelta> {
        if self.stopped {
            return Ok(TextDelta::default());
        }
        let mut delta = match self.stream.finish(tokenizer)? {
            Some(rest) => self.push_text(&rest),
            None => TextDelta::default(),
        };
        if !self.stopped {
            delta.text.push_str(&std::mem::take(&mut self.held));
        }
        Ok(delta)
    }

    /// Cuts `held` at the first stop string, or hands out all of it but
    /// the longest tail that a stop string starts with.
    fn release(&mut self) -> TextDelta {
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min();
        if let Some(at) = first {
            let mut text = std::mem::take(&mut self.held);
            text.truncate(at);
            self.stopped = true;
            return TextDelta {
                text,
                stopped: true,
            };
        }
        let keep = self
            .stops
            .iter()
            .map(|s| partial_overlap(&self.held, s))
            .max()
            .unwrap_or(0);
        let cut = self.held.len() - keep;
        let rest = self.held.split_off(cut);
        TextDelta {
            text: std::mem::replace(&mut self.held, rest),
            stopped: false,
        }
    }
}

/// The length in bytes of the longest tail of `text` that is a proper
/// prefix of `stop` (both cut on character boundaries).
fn partial_overlap(text: &str, stop: &str) -> usize {
    let longest = (stop.len().saturating_sub(1)).min(text.len());
    // `n <= longest <= text.len()`, and the slice is taken only after
    // `is_char_boundary` holds: it cannot panic.
    (1..=longest)
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n)
                && stop.is_char_boundary(n)
                && stop.starts_with(&text[text.len() - n..])
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlap_is_the_longest_prefix_tail() {
        assert_eq!(partial_overlap("hello wo", "world"), 2);
        assert_eq!(partial_overlap("hello", "world"), 0);
        assert_eq!(partial_overlap("aaa", "aab"), 2);
        assert_eq!(partial_overlap("é", "éa"), 2);
        assert_eq!(partial_overlap("x", "x"), 0);
    }

    #[test]
    fn text_splits_at_stops_across_pushes() {
        let mut d = Detokenizer::new(vec!["END".into(), String::new()]);
        let a = d.push_text("abcE");
        assert_eq!(a.text, "abc");
        assert!(!a.stopped);
        let b = d.push_text("Nx");
        assert_eq!(b.text, "ENx");
        let c = d.push_text("yE");
        assert_eq!(c.text, "y");
        let e = d.push_text("NDzz");
        assert_eq!(
            e,
            TextDelta {
                text: String::new(),
                stopped: true
            }
        );
        assert!(d.stopped());
        assert_eq!(d.push_text("more"), TextDelta::default());
    }

    #[test]
    fn earliest_stop_wins() {
        let mut d = Detokenizer::new(vec!["cd".into(), "b".into()]);
        let a = d.push_text("abcd");
        assert_eq!(a.text, "a");
        assert!(a.stopped);
    }
}
