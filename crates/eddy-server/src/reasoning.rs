//! `reasoning_content`: when the chat template enabled thinking, the text inside `<think>…</think>` is
//! reasoning, the rest content. Text arrives in deltas that may cut a tag anywhere, so a possible partial
//! tag is held back until the next delta decides it.

use eddy::chat::ChatTemplate;
use serde_json::{Map, Value};

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

/// Whether a chat request is in thinking mode, and if so whether the generation prompt already opened
/// `<think>` (the output then starts inside the reasoning). `rendered` is the prompt as rendered with the
/// generation prompt.
///
/// Thinking is on when the generation prompt ends inside an open `<think>`, when `chat_template_kwargs`
/// has `enable_thinking: true`, or when it does not say and the template renders differently with
/// `enable_thinking: false` (a template whose default is to think, as Qwen3's).
pub fn thinking_mode(t: &ChatTemplate, messages: &[Value], kwargs: &Map<String, Value>, rendered: &str) -> Option<Start> {
    if let Ok(without) = t.render_json(messages, false, kwargs) {
        if let Some(gen) = rendered.strip_prefix(without.as_str()) {
            if let Some(i) = gen.rfind(OPEN) {
                if !gen[i..].contains(CLOSE) {
                    return Some(Start::Inside);
                }
            }
        }
    }
    match kwargs.get("enable_thinking") {
        Some(Value::Bool(true)) => Some(Start::Expect),
        Some(_) => None,
        None => {
            let mut off = kwargs.clone();
            off.insert("enable_thinking".into(), Value::Bool(false));
            match t.render_json(messages, true, &off) {
                Ok(r) if r != rendered => Some(Start::Expect),
                _ => None,
            }
        }
    }
}

/// Where the output of a thinking request starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// The model is expected to open `<think>` itself (if it does not, everything is content).
    Expect,
    /// The prompt opened `<think>`: the output starts as reasoning.
    Inside,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum State {
    /// Before the first non-blank text: maybe an opening `<think>`.
    Start,
    /// Inside `<think>`; `fresh` = nothing emitted yet (leading blanks are dropped).
    Reasoning { fresh: bool },
    /// After `</think>` (or without any): content; `fresh` = leading blanks are dropped.
    Content { fresh: bool },
}

/// Reasoning and content text of one delta (either may be empty).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Split {
    pub reasoning: String,
    pub content: String,
}

/// Splits streamed text into reasoning and content.
#[derive(Debug)]
pub struct ReasoningSplitter {
    state: State,
    held: String,
}

impl ReasoningSplitter {
    pub fn new(start: Start) -> Self {
        ReasoningSplitter {
            state: match start {
                Start::Expect => State::Start,
                Start::Inside => State::Reasoning { fresh: true },
            },
            held: String::new(),
        }
    }

    /// Adds a delta; returns what can be emitted now.
    pub fn push(&mut self, text: &str) -> Split {
        self.held.push_str(text);
        let mut out = Split::default();
        loop {
            match self.state {
                State::Start => {
                    let t = self.held.trim_start();
                    if let Some(rest) = t.strip_prefix(OPEN) {
                        self.held = rest.to_string();
                        self.state = State::Reasoning { fresh: true };
                    } else if OPEN.starts_with(t) {
                        return out; // blank, or a prefix of <think>: wait
                    } else {
                        self.state = State::Content { fresh: false };
                    }
                }
                State::Reasoning { fresh } => {
                    if fresh && !drop_leading_blanks(&mut self.held) {
                        return out;
                    }
                    self.state = State::Reasoning { fresh: false };
                    if let Some(i) = self.held.find(CLOSE) {
                        out.reasoning.push_str(&self.held[..i]);
                        self.held.drain(..i + CLOSE.len());
                        self.state = State::Content { fresh: true };
                        continue;
                    }
                    let keep = partial_tag_suffix(&self.held, CLOSE);
                    let cut = self.held.len() - keep;
                    out.reasoning.extend(self.held.drain(..cut));
                    return out;
                }
                State::Content { fresh } => {
                    if fresh && !drop_leading_blanks(&mut self.held) {
                        return out;
                    }
                    self.state = State::Content { fresh: false };
                    out.content.push_str(&self.held);
                    self.held.clear();
                    return out;
                }
            }
        }
    }

    /// End of the output: whatever is still held back.
    pub fn finish(&mut self) -> Split {
        let held = std::mem::take(&mut self.held);
        match self.state {
            State::Reasoning { .. } => Split { reasoning: held, content: String::new() },
            State::Start => Split { reasoning: String::new(), content: held },
            State::Content { .. } => Split { reasoning: String::new(), content: if held.trim().is_empty() { String::new() } else { held } },
        }
    }
}

/// Drops leading white space; false when nothing else is left (keep waiting).
fn drop_leading_blanks(s: &mut String) -> bool {
    let n = s.len() - s.trim_start().len();
    s.drain(..n);
    !s.is_empty()
}

/// Length of the longest suffix of `s` that is a proper prefix of `tag`.
fn partial_tag_suffix(s: &str, tag: &str) -> usize {
    (1..tag.len().min(s.len() + 1)).rev().find(|&n| s.is_char_boundary(s.len() - n) && tag.starts_with(&s[s.len() - n..])).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split_all(start: Start, deltas: &[&str]) -> Split {
        let mut s = ReasoningSplitter::new(start);
        let mut all = Split::default();
        let mut parts: Vec<Split> = deltas.iter().map(|d| s.push(d)).collect();
        parts.push(s.finish());
        for d in parts {
            all.reasoning.push_str(&d.reasoning);
            all.content.push_str(&d.content);
        }
        all
    }

    #[test]
    fn tags_split_anywhere_give_the_same_result() {
        let text = "<think>\nLet me see: 2+2 < 5, é.\n</think>\n\nThe answer is 4.";
        let want = Split { reasoning: "Let me see: 2+2 < 5, é.\n".into(), content: "The answer is 4.".into() };
        assert_eq!(split_all(Start::Expect, &[text]), want);
        let cuts: Vec<usize> = (0..=text.len()).filter(|&i| text.is_char_boundary(i)).collect();
        for &i in &cuts {
            for &j in cuts.iter().filter(|&&j| j >= i) {
                let got = split_all(Start::Expect, &[&text[..i], &text[i..j], &text[j..]]);
                assert_eq!(got, want, "cut at {i}, {j}");
            }
        }
        // One character at a time: nothing of a tag ever leaks into either part.
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let refs: Vec<&str> = chars.iter().map(String::as_str).collect();
        assert_eq!(split_all(Start::Expect, &refs), want);
    }

    #[test]
    fn prompt_opened_think_starts_inside() {
        let got = split_all(Start::Inside, &["I should add.</th", "ink>Four"]);
        assert_eq!(got.reasoning, "I should add.");
        assert_eq!(got.content, "Four");
        // Never closed (cut by max_tokens): all reasoning, no content.
        let got = split_all(Start::Inside, &["thinking <", "/thi"]);
        assert_eq!(got.reasoning, "thinking </thi");
        assert_eq!(got.content, "");
    }

    #[test]
    fn no_think_tag_is_all_content_verbatim() {
        let got = split_all(Start::Expect, &["\n<", "b>bold</b> <think>x</think>"]);
        assert_eq!(got.reasoning, "");
        assert_eq!(got.content, "\n<b>bold</b> <think>x</think>");
        let got = split_all(Start::Expect, &["<thi"]);
        assert_eq!(got.content, "<thi");
    }
}
