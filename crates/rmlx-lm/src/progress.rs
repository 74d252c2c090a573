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
            bar.set_style(
                ProgressStyle::with_template(template)
                    .expect("valid template")
                    .progress_chars("=> "),
            );
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

    /// Ends the report.
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}
