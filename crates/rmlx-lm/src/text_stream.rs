//! A request's text as its tokens arrive: incremental detokenisation and stop strings. The text
//! that could still grow into a stop string is held back; a stop string ends the text before it.

use crate::tokenizer::StreamDecoder;
use crate::Result;

pub struct TextStream {
    decoder: StreamDecoder,
    stop: StopFilter,
}

impl TextStream {
    /// A stream decoding with `decoder` and ending at the first of `stop_strings`.
    pub fn new(decoder: StreamDecoder, stop_strings: Vec<String>) -> TextStream {
        TextStream { decoder, stop: StopFilter::new(stop_strings) }
    }

    /// Adds token `id`; returns the text that can be handed out now (possibly empty).
    pub fn push(&mut self, id: u32) -> Result<String> {
        let piece = self.decoder.push(id)?;
        Ok(self.stop.push(&piece))
    }

    /// The text still held (an incomplete character, a possible stop string's beginning): what
    /// is left when generation ends for another reason than a stop string.
    pub fn finish(&mut self) -> Result<String> {
        if self.stop.stopped() {
            return Ok(String::new());
        }
        let rest = self.decoder.finish()?;
        let mut out = self.stop.push(&rest);
        out.push_str(&self.stop.finish());
        Ok(out)
    }

    /// Whether a stop string was met (the text ended before it).
    pub fn stopped(&self) -> bool {
        self.stop.stopped()
    }

    /// A generated token's text, all that is held when it is the last the budget allows, and
    /// whether generation ends with it (a stop string, else the budget).
    pub fn token(&mut self, id: u32, budget_left: bool) -> Result<(String, Option<crate::FinishReason>)> {
        let mut text = self.push(id)?;
        if !budget_left && !self.stopped() {
            text.push_str(&self.finish()?);
        }
        let end = if self.stopped() {
            Some(crate::FinishReason::StopString)
        } else if !budget_left {
            Some(crate::FinishReason::Length)
        } else {
            None
        };
        Ok((text, end))
    }
}

/// Stop strings over text arriving in pieces: holds back what could still grow into a stop
/// string, and ends the text before the first one met.
pub struct StopFilter {
    /// Text not handed out yet: it may begin a stop string.
    held: String,
    stop_strings: Vec<String>,
    stopped: bool,
}

impl StopFilter {
    pub fn new(stop_strings: Vec<String>) -> StopFilter {
        StopFilter { held: String::new(), stop_strings, stopped: false }
    }

    /// Adds `piece`; returns the text that can be handed out now (possibly empty).
    pub fn push(&mut self, piece: &str) -> String {
        self.held.push_str(piece);
        self.release(false)
    }

    /// Everything still held (nothing after a stop string).
    pub fn finish(&mut self) -> String {
        self.release(true)
    }

    /// Whether a stop string was met.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    fn release(&mut self, all: bool) -> String {
        if self.stopped {
            return String::new();
        }
        for s in &self.stop_strings {
            if let Some(at) = self.held.find(s.as_str()) {
                self.stopped = true;
                let out = self.held[..at].to_string();
                self.held.clear();
                return out;
            }
        }
        if all {
            return std::mem::take(&mut self.held);
        }
        let keep = self
            .stop_strings
            .iter()
            .flat_map(|s| (1..s.len()).filter(|&n| s.is_char_boundary(n)).map(move |n| &s[..n]))
            .filter(|prefix| self.held.ends_with(prefix))
            .map(str::len)
            .max()
            .unwrap_or(0);
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::StopFilter;

    #[test]
    fn holds_back_a_possible_stop_string_and_ends_before_it() {
        let mut f = StopFilter::new(vec!["END".into()]);
        assert_eq!(f.push("one E"), "one ");
        assert_eq!(f.push("N"), "");
        assert_eq!(f.push("D two"), "");
        assert!(f.stopped());
        assert_eq!(f.finish(), "");
    }

    #[test]
    fn releases_what_stops_being_a_prefix_and_the_rest_at_the_end() {
        let mut f = StopFilter::new(vec!["END".into(), "\n\n".into()]);
        assert_eq!(f.push("a EN"), "a ");
        assert_eq!(f.push("x\n"), "ENx");
        assert_eq!(f.push("y"), "\ny");
        assert_eq!(f.push("E"), "");
        assert!(!f.stopped());
        assert_eq!(f.finish(), "E");
    }

    #[test]
    fn a_stop_string_cut_inside_a_multibyte_character_is_still_found() {
        let mut f = StopFilter::new(vec!["é!".into()]);
        assert_eq!(f.push("caf"), "caf");
        assert_eq!(f.push("é"), "");
        assert_eq!(f.push("!x"), "");
        assert!(f.stopped());
    }
}
