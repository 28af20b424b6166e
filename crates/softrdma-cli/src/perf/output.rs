//! Output of `softrdma perf`: the human table, JSON lines, CSV, the SVG
//! plot and the progress indicator.

use std::io::{IsTerminal, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::{Baseline, Format, Mode, PROGRESS, Params, RATIO_BW, RATIO_LAT, Row, lat_kind};

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

/// How rows are printed.
#[derive(Debug, Clone, Copy)]
pub(super) struct Style {
    /// Table, JSON or CSV.
    pub(super) format: Format,
    /// The human table's bandwidth in MiB/s (2^20, perftest's "MB").
    pub(super) mib: bool,
    /// The TCP baseline of the rows, if any.
    pub(super) baseline: Option<Baseline>,
}

const CSV_HEADER: &str = "test,mode,size,iters,mb_s,mib_s,gbit_s,mmsg_s,lat_kind,\
lat_min_us,lat_mean_us,lat_stdev_us,lat_p50_us,lat_p99_us,lat_p999_us,lat_max_us,\
cpu_us_per_msg,baseline,tcp_mb_s,tcp_lat_mean_us,tcp_lat_stdev_us,tcp_lat_p50_us,\
tcp_lat_p99_us,tcp_lat_p999_us,tcp_lat_max_us,ratio,ratio_of";

fn opt(x: Option<f64>) -> String {
    x.map_or(String::new(), |v| format!("{v}"))
}

/// A CSV field: quoted when it holds a comma or a quote.
fn csv_text(s: &str) -> String {
    if s.contains([',', '"']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

/// The run's parameters in one line (the human title and the plot's).
pub(super) fn title(p: &Params, place: &str) -> String {
    format!(
        "softrdma perf {} {} ({place}), depth {}, qps {}, inline {}, CRC {}, {}{}",
        p.test.name(),
        if p.mode == Mode::Bw {
            "bandwidth"
        } else {
            "latency"
        },
        if p.mode == Mode::Bw { p.depth } else { 1 },
        p.nqps(),
        p.inline,
        if p.crc { "on" } else { "off" },
        if p.event {
            "event-driven"
        } else if p.spin {
            "busy polling (--spin)"
        } else {
            "busy polling 50 µs, then sleeping"
        },
        if p.force_datamover {
            ", datamover forced"
        } else {
            ""
        },
    )
}

/// Writes the table header (human: a title line naming the test and where
/// it runs, `place`, what the latency columns and the ratio mean, then the
/// column names; CSV: the column names).
pub(super) fn header(
    out: &mut dyn Write,
    st: Style,
    p: &Params,
    place: &str,
) -> std::io::Result<()> {
    // Busy-polling threads of this process: both ends in loopback.
    let spinning = if place == "loopback" { 2 } else { 1 };
    let warning = crate::load::Load::now().warning(spinning);
    match st.format {
        Format::Json | Format::Csv => {
            if let Some(w) = &warning {
                eprintln!("softrdma perf: warning: {w}");
            }
            if st.format == Format::Csv {
                writeln!(out, "{CSV_HEADER}")?;
            }
            Ok(())
        }
        Format::Human => {
            writeln!(out, "# {}", title(p, place))?;
            if let Some(w) = &warning {
                writeln!(out, "# warning: {w}")?;
            }
            writeln!(
                out,
                "# latency columns (µs): {}{}",
                lat_kind(p),
                if p.mode == Mode::Bw {
                    " (queueing included; see --lat for latency)"
                } else {
                    ""
                }
            )?;
            if let Some(b) = st.baseline {
                writeln!(
                    out,
                    "# baseline: TCP over loopback or the same link, {}; ratio = {}",
                    match b {
                        Baseline::Tcp => "blocking sockets (tcp)",
                        Baseline::TcpSpin => "busy-polled non-blocking sockets (tcp-spin)",
                    },
                    if p.mode == Mode::Bw {
                        RATIO_BW
                    } else {
                        RATIO_LAT
                    }
                )?;
            }
            write!(
                out,
                "{:>8} {:>9} {:>10} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8}",
                "size",
                "iters",
                if st.mib { "MiB/s" } else { "MB/s" },
                "Gbit/s",
                "Mmsg/s",
                "mean",
                "stdev",
                "p50",
                "p99",
                "p99.9",
                "max",
                "cpu_us"
            )?;
            if st.baseline.is_some() {
                write!(
                    out,
                    " {:>10} {:>8} {:>8} {:>6}",
                    if st.mib { "tcp_MiB/s" } else { "tcp_MB/s" },
                    "tcp_mean",
                    "tcp_p99",
                    "ratio"
                )?;
            }
            writeln!(out)
        }
    }
}

/// Writes one row.
pub(super) fn line(out: &mut dyn Write, st: Style, r: &Row) -> std::io::Result<()> {
    match st.format {
        Format::Json => {
            let s = serde_json::to_string(r).map_err(std::io::Error::other)?;
            writeln!(out, "{s}")
        }
        Format::Csv => writeln!(
            out,
            "{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}",
            r.test.name(),
            if r.mode == Mode::Bw { "bw" } else { "lat" },
            r.size,
            r.iters,
            r.mb_s,
            r.mib_s,
            r.gbit_s,
            r.mmsg_s,
            csv_text(&r.lat_kind),
            r.lat_min_us,
            r.lat_mean_us,
            r.lat_stdev_us,
            r.lat_p50_us,
            r.lat_p99_us,
            r.lat_p999_us,
            r.lat_max_us,
            r.cpu_us_per_msg,
            r.baseline.unwrap_or(""),
            opt(r.tcp_mb_s),
            opt(r.tcp_lat_mean_us),
            opt(r.tcp_lat_stdev_us),
            opt(r.tcp_lat_p50_us),
            opt(r.tcp_lat_p99_us),
            opt(r.tcp_lat_p999_us),
            opt(r.tcp_lat_max_us),
            opt(r.ratio),
            csv_text(r.ratio_of.unwrap_or("")),
        ),
        Format::Human => {
            let bw = |mb: f64| if st.mib { mb * 1e6 / 1048576.0 } else { mb };
            write!(
                out,
                "{:>8} {:>9} {:>10.1} {:>8.3} {:>8.3} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8.2}",
                human_size(r.size),
                r.iters,
                bw(r.mb_s),
                r.gbit_s,
                r.mmsg_s,
                r.lat_mean_us,
                r.lat_stdev_us,
                r.lat_p50_us,
                r.lat_p99_us,
                r.lat_p999_us,
                r.lat_max_us,
                r.cpu_us_per_msg
            )?;
            if st.baseline.is_some() {
                let f = |v: Option<f64>, w: usize, d: usize| {
                    v.map_or(format!("{:>w$}", "-"), |v| format!("{v:>w$.d$}"))
                };
                write!(
                    out,
                    " {} {} {} {}",
                    f(r.tcp_mb_s.map(bw), 10, 1),
                    f(r.tcp_lat_mean_us, 8, 2),
                    f(r.tcp_lat_p99_us, 8, 2),
                    f(r.ratio, 6, 2)
                )?;
            }
            writeln!(out)
        }
    }
}

/// Ticks of a logarithmic axis from `lo` to `hi` (> 0): 1, 2, 5 × 10^k.
fn log_ticks(lo: f64, hi: f64) -> Vec<f64> {
    let mut t = Vec::new();
    let mut e = lo.log10().floor() as i32;
    while 10f64.powi(e) <= hi * 1.0001 {
        for m in [1.0, 2.0, 5.0] {
            let v = m * 10f64.powi(e);
            if v >= lo * 0.9999 && v <= hi * 1.0001 {
                t.push(v);
            }
        }
        e += 1;
    }
    t
}

/// A tick label: `0.5`, `20`, `1k`, `2M`.
fn tick_label(v: f64) -> String {
    if v >= 1e6 {
        format!("{}M", v / 1e6)
    } else if v >= 1e3 {
        format!("{}k", v / 1e3)
    } else if v >= 1.0 {
        format!("{v}")
    } else {
        format!("{v:.2}").trim_end_matches('0').to_string()
    }
}

/// Draws bandwidth (left, linear axis) and mean latency with a band from
/// the median to the 99th percentile (right, logarithmic axis) against the
/// message size (logarithmic axis), with the TCP baseline dashed where it
/// has the number (a TCP stream has no per-message latency: no line).
/// `title` names the run's parameters.
pub fn svg(rows: &[Row], title: &str) -> String {
    use std::fmt::Write as _;
    const W: f64 = 460.0;
    const H: f64 = 320.0;
    const ML: f64 = 64.0;
    const MT: f64 = 48.0;
    const PW: f64 = W - ML - 20.0;
    const PH: f64 = H - MT - 50.0;
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{H}" font-family="sans-serif" font-size="11">"#,
        2.0 * W
    );
    let _ = write!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = write!(
        s,
        r#"<text x="{W}" y="16" text-anchor="middle" font-size="13">{}</text>"#,
        xml(title)
    );
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
    let lat_kind = rows.first().map_or(String::new(), |r| r.lat_kind.clone());
    for k in 0..2 {
        let ox = f64::from(k) * W + ML;
        let bw = k == 0;
        let name = if bw {
            "bandwidth, MB/s".to_string()
        } else {
            format!("mean latency, µs, band p50..p99 ({lat_kind})")
        };
        let main: Vec<f64> = rows
            .iter()
            .map(|r| if bw { r.mb_s } else { r.lat_mean_us })
            .collect();
        let tcp: Vec<Option<f64>> = rows
            .iter()
            .map(|r| if bw { r.tcp_mb_s } else { r.tcp_lat_mean_us })
            .collect();
        let mut all: Vec<f64> = main
            .iter()
            .copied()
            .chain(tcp.iter().flatten().copied())
            .collect();
        if !bw {
            all.extend(rows.iter().flat_map(|r| [r.lat_p50_us, r.lat_p99_us]));
        }
        let all: Vec<f64> = all
            .into_iter()
            .filter(|v| v.is_finite() && *v > 0.0)
            .collect();
        let hi = all.iter().copied().fold(1e-9f64, f64::max);
        let lo = all.iter().copied().fold(f64::MAX, f64::min).min(hi);
        // Latency: log axis over whole decades; bandwidth: linear from 0.
        let (ylo, yhi) = if bw {
            (0.0, hi * 1.1)
        } else {
            (
                10f64.powf(lo.max(1e-3).log10().floor()),
                10f64
                    .powf(hi.max(1e-3).log10().ceil())
                    .max(10f64.powf(lo.max(1e-3).log10().floor() + 1.0)),
            )
        };
        let px = |x: f64| ox + (x - x0) / (x1 - x0) * PW;
        let py = |y: f64| {
            if bw {
                MT + PH - (y - ylo) / (yhi - ylo) * PH
            } else {
                let f = (y.max(ylo).log10() - ylo.log10()) / (yhi.log10() - ylo.log10());
                MT + PH - f * PH
            }
        };
        let _ = write!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle" font-size="12">{}</text>"#,
            ox + PW / 2.0,
            MT - 8.0,
            xml(&name)
        );
        let _ = write!(
            s,
            r##"<rect x="{ox}" y="{MT}" width="{PW}" height="{PH}" fill="none" stroke="#444"/>"##
        );
        let ticks: Vec<f64> = if bw {
            (0..=4).map(|i| yhi * f64::from(i) / 4.0).collect()
        } else {
            log_ticks(ylo, yhi)
        };
        for y in ticks {
            let yy = py(y);
            let label = if bw {
                if y >= 100.0 {
                    format!("{y:.0}")
                } else {
                    format!("{y:.2}")
                }
            } else {
                tick_label(y)
            };
            let _ = write!(
                s,
                r##"<line x1="{ox}" x2="{}" y1="{yy:.1}" y2="{yy:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" text-anchor="end">{label}</text>"##,
                ox + PW,
                ox - 4.0,
                yy + 4.0,
            );
        }
        let mut e = x0.ceil() as i64;
        let step = (((x1 - x0) / 8.0).ceil() as i64).max(1);
        while (e as f64) <= x1 {
            let x = px(e as f64);
            let _ = write!(
                s,
                r#"<text x="{x:.1}" y="{}" text-anchor="middle">{}</text>"#,
                MT + PH + 14.0,
                human_size(1usize << e.clamp(0, 62))
            );
            e += step;
        }
        let _ = write!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle">message size, bytes (log scale)</text>"#,
            ox + PW / 2.0,
            MT + PH + 32.0
        );
        if !bw && !rows.is_empty() {
            // The p50..p99 band.
            let upper = xs
                .iter()
                .zip(rows)
                .map(|(&x, r)| format!("{:.1},{:.1}", px(x), py(r.lat_p99_us)));
            let lower = xs
                .iter()
                .zip(rows)
                .rev()
                .map(|(&x, r)| format!("{:.1},{:.1}", px(x), py(r.lat_p50_us)));
            let pts: Vec<String> = upper.chain(lower).collect();
            let _ = write!(
                s,
                r##"<polygon points="{}" fill="#1f77b4" fill-opacity="0.18" stroke="none"/>"##,
                pts.join(" ")
            );
        }
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
            main.iter().map(|&v| Some(v)).collect(),
            "#1f77b4",
            "",
            "softrdma",
            0,
        );
        if tcp.iter().any(Option::is_some) {
            let name = rows.iter().find_map(|r| r.baseline).unwrap_or("tcp");
            series(tcp, "#d62728", r#"stroke-dasharray="5,3""#, name, 1);
        }
    }
    s.push_str("</svg>\n");
    s
}

/// Escapes text for SVG.
fn xml(t: &str) -> String {
    t.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}
