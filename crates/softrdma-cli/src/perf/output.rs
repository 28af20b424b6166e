//! Output of `softrdma perf`: the human table, JSON lines, CSV, the SVG
//! plot and the progress indicator.

use std::io::{IsTerminal, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::{Format, Mode, PROGRESS, Params, Row};

pub(super) fn human_size(n: usize) -> String {
    if n >= 1 << 20 && n.is_multiple_of(1 << 20) {
        format!("{}M", n >> 20)
    } else if n >= 1 << 10 && n.is_multiple_of(1 << 10) {
        format!("{}K", n >> 10)
    } else {
        n.to_string()
    }
}

/// `n` bytes in binary units: `512 B`, `64 KiB`, `1.5 GiB`.
pub(super) fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 || v.fract() == 0.0 {
        format!("{v:.0} {}", UNITS[u])
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// Shows progress on stderr (when it is a terminal) for runs over 2 s.
pub(super) struct Progress {
    stop: Arc<AtomicBool>,
    label: Arc<std::sync::Mutex<String>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Progress {
    pub(super) fn start() -> Progress {
        let stop = Arc::new(AtomicBool::new(false));
        let label = Arc::new(std::sync::Mutex::new(String::new()));
        let thread = std::io::stderr().is_terminal().then(|| {
            let stop = stop.clone();
            let label = label.clone();
            std::thread::spawn(move || {
                let t0 = Instant::now();
                let mut shown = false;
                while !stop.load(Ordering::Acquire) {
                    std::thread::sleep(Duration::from_millis(250));
                    if t0.elapsed() > Duration::from_secs(2) {
                        let l = label.lock().map(|g| g.clone()).unwrap_or_default();
                        eprint!(
                            "\r\x1b[K[{:5.1} s] {l}: {} messages",
                            t0.elapsed().as_secs_f64(),
                            PROGRESS.load(Ordering::Relaxed)
                        );
                        shown = true;
                    }
                }
                if shown {
                    eprint!("\r\x1b[K");
                }
            })
        });
        Progress {
            stop,
            label,
            thread,
        }
    }
    pub(super) fn set(&self, s: String) {
        PROGRESS.store(0, Ordering::Relaxed);
        if let Ok(mut g) = self.label.lock() {
            *g = s;
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

const CSV_HEADER: &str = "test,mode,size,iters,mb_s,gbit_s,mmsg_s,lat_min_us,lat_median_us,lat_p99_us,lat_max_us,cpu_us_per_msg,tcp_mb_s,tcp_lat_median_us,ratio";

fn opt(x: Option<f64>) -> String {
    x.map_or(String::new(), |v| format!("{v}"))
}

/// Writes the table header (human: a title line naming the test and where
/// it runs, `place`, then the column names; CSV: the column names).
pub(super) fn header(
    out: &mut dyn Write,
    format: Format,
    baseline_tcp: bool,
    p: &Params,
    place: &str,
) -> std::io::Result<()> {
    match format {
        Format::Json => Ok(()),
        Format::Csv => writeln!(out, "{CSV_HEADER}"),
        Format::Human => {
            writeln!(
                out,
                "# softrdma perf {} {} ({place}), depth {}, qps {}, inline {}, CRC {}, {}{}",
                p.test.name(),
                if p.mode == Mode::Bw {
                    "bandwidth"
                } else {
                    "latency"
                },
                if p.mode == Mode::Bw { p.depth } else { 1 },
                p.qps,
                p.inline,
                if p.crc { "on" } else { "off" },
                if p.event {
                    "event-driven"
                } else {
                    "busy polling"
                },
                if p.force_datamover {
                    ", datamover forced"
                } else {
                    ""
                },
            )?;
            write!(
                out,
                "{:>8} {:>9} {:>10} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8}",
                "size",
                "iters",
                "MB/s",
                "Gbit/s",
                "Mmsg/s",
                "min_us",
                "med_us",
                "p99_us",
                "max_us",
                "cpu_us"
            )?;
            if baseline_tcp {
                write!(out, " {:>10} {:>8} {:>6}", "tcp_MB/s", "tcp_med", "ratio")?;
            }
            writeln!(out)
        }
    }
}

/// Writes one row.
pub(super) fn line(out: &mut dyn Write, format: Format, r: &Row) -> std::io::Result<()> {
    match format {
        Format::Json => {
            let s = serde_json::to_string(r).map_err(std::io::Error::other)?;
            writeln!(out, "{s}")
        }
        Format::Csv => writeln!(
            out,
            "{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}",
            r.test.name(),
            if r.mode == Mode::Bw { "bw" } else { "lat" },
            r.size,
            r.iters,
            r.mb_s,
            r.gbit_s,
            r.mmsg_s,
            r.lat_min_us,
            r.lat_median_us,
            r.lat_p99_us,
            r.lat_max_us,
            r.cpu_us_per_msg,
            opt(r.tcp_mb_s),
            opt(r.tcp_lat_median_us),
            opt(r.ratio)
        ),
        Format::Human => {
            write!(
                out,
                "{:>8} {:>9} {:>10.1} {:>8.3} {:>8.3} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8.2}",
                human_size(r.size),
                r.iters,
                r.mb_s,
                r.gbit_s,
                r.mmsg_s,
                r.lat_min_us,
                r.lat_median_us,
                r.lat_p99_us,
                r.lat_max_us,
                r.cpu_us_per_msg
            )?;
            if let (Some(t), Some(l), Some(q)) = (r.tcp_mb_s, r.tcp_lat_median_us, r.ratio) {
                write!(out, " {t:>10.1} {l:>8.2} {q:>6.2}")?;
            }
            writeln!(out)
        }
    }
}

/// A plot panel: title, softrdma value, TCP value.
type Panel = (&'static str, fn(&Row) -> f64, fn(&Row) -> Option<f64>);

/// Draws bandwidth (left) and median latency (right) against message size
/// (log2 axis), with the TCP baseline dashed when present.
pub fn svg(rows: &[Row]) -> String {
    use std::fmt::Write as _;
    const W: f64 = 440.0;
    const H: f64 = 300.0;
    const ML: f64 = 60.0;
    const MT: f64 = 30.0;
    const PW: f64 = W - ML - 20.0;
    const PH: f64 = H - MT - 50.0;
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{H}" font-family="sans-serif" font-size="11">"#,
        2.0 * W
    );
    let _ = write!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let test = rows.first().map_or("", |r| r.test.name());
    let panels: [Panel; 2] = [
        ("bandwidth, MB/s", |r| r.mb_s, |r| r.tcp_mb_s),
        (
            "median latency, µs",
            |r| r.lat_median_us,
            |r| r.tcp_lat_median_us,
        ),
    ];
    let xs: Vec<f64> = rows.iter().map(|r| (r.size as f64).log2()).collect();
    let (x0, x1) = xs
        .iter()
        .fold((f64::MAX, f64::MIN), |(a, b), &x| (a.min(x), b.max(x)));
    let (x0, x1) = if xs.is_empty() {
        (0.0, 1.0)
    } else if x1 - x0 < 1.0 {
        (x0 - 0.5, x1 + 0.5)
    } else {
        (x0, x1)
    };
    for (k, (title, f, g)) in panels.iter().enumerate() {
        let ox = k as f64 * W + ML;
        let ymax = rows
            .iter()
            .map(|r| f(r).max(g(r).unwrap_or(0.0)))
            .fold(0.0f64, f64::max)
            .max(1e-9)
            * 1.1;
        let px = |x: f64| ox + (x - x0) / (x1 - x0) * PW;
        let py = |y: f64| MT + PH - y / ymax * PH;
        let _ = write!(
            s,
            r#"<text x="{}" y="18" text-anchor="middle" font-size="13">softrdma {test}: {title}</text>"#,
            ox + PW / 2.0
        );
        let _ = write!(
            s,
            r##"<rect x="{ox}" y="{MT}" width="{PW}" height="{PH}" fill="none" stroke="#444"/>"##
        );
        for i in 0..=4 {
            let y = ymax * f64::from(i) / 4.0;
            let yy = py(y);
            let _ = write!(
                s,
                r##"<line x1="{ox}" x2="{}" y1="{yy}" y2="{yy}" stroke="#ddd"/><text x="{}" y="{}" text-anchor="end">{}</text>"##,
                ox + PW,
                ox - 4.0,
                yy + 4.0,
                if y >= 100.0 {
                    format!("{y:.0}")
                } else {
                    format!("{y:.2}")
                },
            );
        }
        let mut e = x0.ceil() as i64;
        let step = (((x1 - x0) / 8.0).ceil() as i64).max(1);
        while (e as f64) <= x1 {
            let x = px(e as f64);
            let _ = write!(
                s,
                r#"<text x="{x}" y="{}" text-anchor="middle">{}</text>"#,
                MT + PH + 14.0,
                human_size(1usize << e.clamp(0, 62))
            );
            e += step;
        }
        let _ = write!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle">message size (bytes, log2)</text>"#,
            ox + PW / 2.0,
            MT + PH + 32.0
        );
        let mut series = |vals: Vec<Option<f64>>, color: &str, dash: &str, name: &str, n: usize| {
            let pts: Vec<String> = xs
                .iter()
                .zip(&vals)
                .filter_map(|(&x, v)| v.map(|v| format!("{:.1},{:.1}", px(x), py(v))))
                .collect();
            if pts.is_empty() {
                return;
            }
            let _ = write!(
                s,
                r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2" {dash}/>"#,
                pts.join(" ")
            );
            for pt in &pts {
                let (cx, cy) = pt.split_once(',').unwrap_or(("0", "0"));
                let _ = write!(s, r#"<circle cx="{cx}" cy="{cy}" r="2.5" fill="{color}"/>"#);
            }
            let ly = MT + 14.0 + 14.0 * n as f64;
            let _ = write!(
                s,
                r#"<text x="{}" y="{ly}" fill="{color}">{name}</text>"#,
                ox + 8.0
            );
        };
        series(
            rows.iter().map(|r| Some(f(r))).collect(),
            "#1f77b4",
            "",
            "softrdma",
            0,
        );
        if rows.iter().any(|r| g(r).is_some()) {
            series(
                rows.iter().map(g).collect(),
                "#d62728",
                r#"stroke-dasharray="5,3""#,
                "TCP",
                1,
            );
        }
    }
    s.push_str("</svg>\n");
    s
}
