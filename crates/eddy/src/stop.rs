//! Stop strings: generation ends where the text it writes contains one (OpenAI's `stop`, Anthropic's
//! `stop_sequences`, and the end of a turn a chat template spells in text, [`crate::chat::ChatTemplate::end_text`]).

/// Finds stop strings in streamed text across delta boundaries. Text that could be the start of a stop
/// string is held back until it is known not to be one.
pub struct StopMatcher {
    stops: Vec<String>,
    pending: String,
    /// The stop string found, once one is.
    matched: Option<String>,
}

impl StopMatcher {
    /// A matcher for `stops` (empty strings are ignored).
    pub fn new(stops: Vec<String>) -> Self {
        StopMatcher { stops: stops.into_iter().filter(|s| !s.is_empty()).collect(), pending: String::new(), matched: None }
    }

    /// Adds `text`; returns the text that is safe to emit, and whether a stop string was found (then the
    /// returned text is everything before it and the rest is dropped).
    pub fn push(&mut self, text: &str) -> (String, bool) {
        self.pending.push_str(text);
        // The earliest occurrence; at one position the first listed stop string.
        if let Some((i, s)) = self.stops.iter().filter_map(|s| Some((self.pending.find(s.as_str())?, s))).min_by_key(|e| e.0) {
            let out = self.pending[..i].to_string();
            self.matched = Some(s.clone());
            self.pending.clear();
            return (out, true);
        }
        let cut = self.pending.len() - self.holdback();
        let out: String = self.pending.drain(..cut).collect();
        (out, false)
    }

    /// The stop string that ended the text, if one did.
    pub fn matched(&self) -> Option<&str> {
        self.matched.as_deref()
    }

    /// Everything still held back (at the end of generation).
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }

    /// Length of the longest suffix of `pending` that is a prefix of some stop string.
    fn holdback(&self) -> usize {
        let p = &self.pending;
        p.char_indices().map(|(i, _)| i).find(|&i| self.stops.iter().any(|s| s.starts_with(&p[i..]))).map_or(0, |i| p.len() - i)
    }
}

#[cfg(test)]
mod tests {
    use super::StopMatcher;

    fn run(stops: &[&str], deltas: &[&str]) -> (Vec<String>, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = Vec::new();
        for d in deltas {
            let (t, hit) = m.push(d);
            out.push(t);
            if hit {
                return (out, true);
            }
        }
        out.push(m.flush());
        (out, false)
    }

    #[test]
    fn stop_across_deltas_is_never_emitted() {
        let (out, hit) = run(&["END"], &["abc E", "N", "D tail"]);
        assert!(hit);
        // The earliest match is the one reported.
        let mut m = StopMatcher::new(vec!["b".into(), "END".into()]);
        assert_eq!((m.push("xENDb"), m.matched()), (("x".to_string(), true), Some("END")));
        assert_eq!(StopMatcher::new(vec!["z".into()]).matched(), None);
        assert_eq!(out, vec!["abc ", "", ""]);
    }

    #[test]
    fn false_start_is_released() {
        let (out, hit) = run(&["END"], &["xE", "Ny", "z"]);
        assert!(!hit);
        assert_eq!(out.concat(), "xENyz");
        assert_eq!(out[0], "x");
    }

    #[test]
    fn earliest_of_several_stops_wins_and_multibyte_is_safe() {
        let (out, hit) = run(&["é!", "b"], &["aé", "!b"]);
        assert!(hit);
        assert_eq!(out.concat(), "a");
    }
}
