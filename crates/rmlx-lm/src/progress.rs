//! Progress reporting on stderr for long work (loading, downloads): a bar on a terminal, a few
//! plain lines otherwise, nothing when disabled.

use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;

/// A progress counter towards `total` units.
pub struct Progress {
    bar: Option<ProgressBar>,
    plain: Option<(String, u64, std::cell::Cell<u64>, std::cell::Cell<u64>)>,
}

impl Progress {
    /// Starts reporting `what` (nothing is shown unless `enabled`).
    pub fn new(enabled: bool, what: &str, total: u64) -> Self {
        Self::with_template(enabled, what, total, "{msg} [{bar:30}] {pos}/{len} ({elapsed})")
    }

    /// Like [`Progress::new`], for a count of bytes (the bar shows sizes, rate and time left).
    pub fn bytes(enabled: bool, what: &str, total: u64) -> Self {
        let template = "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}";
        Self::with_template(enabled, what, total, template)
    }

    fn with_template(enabled: bool, what: &str, total: u64, template: &str) -> Self {
        if !enabled {
            return Self { bar: None, plain: None };
        }
        if std::io::stderr().is_terminal() {
            let bar = ProgressBar::new(total);
            bar.set_style(ProgressStyle::with_template(template).expect("valid template").progress_chars("=> "));
            bar.set_message(what.to_string());
            Self { bar: Some(bar), plain: None }
        } else {
            Self { bar: None, plain: Some((what.to_string(), total, 0.into(), 0.into())) }
        }
    }

    /// Adds `n` units.
    pub fn inc(&self, n: u64) {
        if let Some(bar) = &self.bar {
            bar.inc(n);
        }
        if let Some((what, total, done, shown)) = &self.plain {
            done.set(done.get() + n);
            let quarter = done.get() * 4 / (*total).max(1);
            if quarter > shown.get() && quarter < 4 {
                shown.set(quarter);
                eprintln!("{what}: {}%", quarter * 25);
            }
        }
    }

    /// Moves to `pos` units done.
    pub fn set(&self, pos: u64) {
        let done = self
            .bar
            .as_ref()
            .map(ProgressBar::position)
            .or_else(|| self.plain.as_ref().map(|p| p.2.get()))
            .unwrap_or(0);
        if pos > done {
            self.inc(pos - done);
        }
    }

    /// Prints a line on stderr above the bar (plainly when there is none).
    pub fn println(&self, line: &str) {
        match &self.bar {
            Some(bar) => bar.println(line),
            None => eprintln!("{line}"),
        }
    }

    /// Ends the report.
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}
