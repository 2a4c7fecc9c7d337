//! The charts of `tollgate replay --plot`: admitted per second for each design on one axis,
//! and optionally one bucket's tokens over time, written as SVG or PNG by the file's extension.
//!
//! Everything drawn is counted exactly during the replay (admissions per bin; a bucket's units
//! before and after each of its checks) and only turned into floating point for drawing. The
//! font is compiled in, so a chart looks the same on any machine and needs no font library.

use std::collections::HashMap;
use std::path::Path;
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;
use plotters::style::FontStyle;

use super::algorithms::Verdict;
use super::trace::{format_time_us, parse_micros, parse_time_us};
use super::{Design, ReplayError, setting};
use tollgate_limit::bucket::{BucketParams, US_PER_S};

/// What `--plot` writes, from the file's extension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Svg,
    Png,
}

impl Format {
    /// `.svg` or `.png`, in any case; anything else is refused before the replay starts.
    pub fn of(path: &Path) -> Result<Format, ReplayError> {
        let ext = path
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase);
        match ext.as_deref() {
            Some("svg") => Ok(Format::Svg),
            Some("png") => Ok(Format::Png),
            Some(other) => Err(setting(
                "--plot",
                format!(
                    "{}: unknown extension \".{other}\"; the extension picks the format: .svg or .png",
                    path.display()
                ),
            )),
            None => Err(setting(
                "--plot",
                format!(
                    "{}: no extension; the extension picks the format: .svg or .png",
                    path.display()
                ),
            )),
        }
    }
}

/// The span a chart shows, in trace time (µs): `[from, to)`, either end open.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Window {
    pub from: Option<u64>,
    pub to: Option<u64>,
}

impl Window {
    /// `FROM..TO`: trace times in decimal seconds as in the trace's time column, either left
    /// out for the trace's own start or end; `TO` may be `+DURATION` (`+300ms`, `+2s`) after
    /// `FROM`.
    pub fn parse(text: &str) -> Result<Window, String> {
        let Some((from, to)) = text.split_once("..") else {
            return Err(format!(
                "{text:?}: a window is FROM..TO in trace seconds, such as 32400..32400.3 or 32400..+300ms"
            ));
        };
        let time = |t: &str| -> Result<Option<u64>, String> {
            if t.is_empty() {
                return Ok(None);
            }
            parse_time_us(t.as_bytes()).map(Some)
        };
        let from_us = time(from.trim())?;
        let to = to.trim();
        let to_us = match to.strip_prefix('+') {
            Some(d) => {
                let Some(f) = from_us else {
                    return Err(format!("{text:?}: +{d} counts from FROM, so FROM is needed"));
                };
                let d = parse_micros(d)?;
                Some(
                    f.checked_add(d)
                        .ok_or_else(|| format!("{text:?}: the window ends too late"))?,
                )
            }
            None => time(to)?,
        };
        if let (Some(f), Some(t)) = (from_us, to_us)
            && t <= f
        {
            return Err(format!("{text:?}: the window must end after it starts"));
        }
        Ok(Window {
            from: from_us,
            to: to_us,
        })
    }

    pub fn contains(&self, t: u64) -> bool {
        self.from.is_none_or(|f| t >= f) && self.to.is_none_or(|e| t < e)
    }

    /// Admissions are counted per second, or in finer bins when a short window is given, so
    /// a 300 ms window still shows its shape: at least 30 bins, each 1, 2 or 5 × 10^k µs.
    fn bin_us(&self) -> u64 {
        let (Some(f), Some(t)) = (self.from, self.to) else {
            return US_PER_S;
        };
        let target = ((t - f) / 30).max(1);
        let mut best = 1;
        let mut step = 1;
        while step <= US_PER_S {
            for m in [1, 2, 5] {
                if step * m <= target {
                    best = step * m;
                }
            }
            step *= 10;
        }
        best.min(US_PER_S)
    }
}

/// Each design's admissions, counted in bins of the window, and the rows' time span.
pub struct Admitted {
    window: Window,
    bin: u64,
    origin: u64,
    counts: Vec<HashMap<u64, u64>>,
    first: Option<u64>,
    last: Option<u64>,
}

impl Admitted {
    pub fn new(window: Window, designs: usize) -> Admitted {
        Admitted {
            window,
            bin: window.bin_us(),
            // Bins start at FROM; without one, on whole multiples from time 0 (clock seconds).
            origin: window.from.unwrap_or(0),
            counts: vec![HashMap::new(); designs],
            first: None,
            last: None,
        }
    }

    /// One trace row and each design's verdict on it, in `--design` order.
    pub fn row(&mut self, t: u64, verdicts: &[Verdict]) {
        if !self.window.contains(t) {
            return;
        }
        self.first.get_or_insert(t);
        self.last = Some(t);
        let b = (t - self.origin) / self.bin;
        for (c, v) in self.counts.iter_mut().zip(verdicts) {
            if v.admitted {
                *c.entry(b).or_default() += 1;
            }
        }
    }
}

/// One bucket's units just before and just after each of its checks, within a window, and
/// the last state before it: enough to draw the exact sawtooth, refills included.
#[derive(Clone, Debug)]
pub struct TokenTrace {
    params: BucketParams,
    window: Window,
    before_window: Option<(u64, u64)>,
    events: Vec<(u64, u64, u64)>,
}

impl TokenTrace {
    pub fn new(params: BucketParams, window: Window) -> TokenTrace {
        TokenTrace {
            params,
            window,
            before_window: None,
            events: Vec::new(),
        }
    }

    /// The bucket held `before` units when a request came at `t` and `after` once decided.
    pub fn record(&mut self, t: u64, before: u64, after: u64) {
        if self.window.from.is_some_and(|f| t < f) {
            self.before_window = Some((t, after));
        } else if self.window.contains(t) {
            self.events.push((t, before, after));
        }
    }

    pub fn params(&self) -> BucketParams {
        self.params
    }

    /// Each check inside the window: its time, and the bucket's units before and after it.
    pub fn events(&self) -> &[(u64, u64, u64)] {
        &self.events
    }

    /// Units at `t`, refilled from `(at, units)` and never above the capacity.
    fn refilled(&self, (at, units): (u64, u64), t: u64) -> u64 {
        let room = self.params.capacity.saturating_sub(units);
        let elapsed = t.saturating_sub(at);
        if elapsed >= room.div_ceil(self.params.refill) {
            self.params.capacity
        } else {
            units + elapsed * self.params.refill
        }
    }

    /// The line through `[start, end]`: straight refills, a corner where the bucket becomes
    /// full, and a vertical step at every check.
    fn points(&self, start: u64, end: u64) -> Vec<(u64, u64)> {
        let cap = self.params.capacity;
        let mut state = match self.before_window {
            Some(s) => (start, self.refilled(s, start)),
            // A bucket never checked is full, as the store treats a missing one.
            None => (start, cap),
        };
        let mut out = vec![state];
        let go_to = |out: &mut Vec<(u64, u64)>, state: (u64, u64), t: u64| {
            if t <= state.0 {
                return;
            }
            let room = cap.saturating_sub(state.1);
            let full_at = state.0.saturating_add(room.div_ceil(self.params.refill));
            if room > 0 && full_at < t {
                out.push((full_at, cap));
            }
            out.push((t, self.refilled(state, t)));
        };
        for &(t, before, after) in &self.events {
            if t > end {
                break;
            }
            go_to(&mut out, state, t);
            if out.last() != Some(&(t, before)) {
                out.push((t, before));
            }
            out.push((t, after));
            state = (t, after);
        }
        go_to(&mut out, state, end);
        out
    }
}

/// Columns of time a token line keeps apart; finer than any pixel of the chart.
const COLUMNS: u64 = 4 * WIDTH as u64;

/// A long trace's token line in at most four points per column of time (the first, lowest,
/// highest and last, in their order), so a million checks draw the same picture as a file of
/// kilobytes instead of hundreds of megabytes.
fn thin(points: Vec<(u64, u64)>, start: u64, end: u64) -> Vec<(u64, u64)> {
    if points.len() as u64 <= 4 * COLUMNS {
        return points;
    }
    let width = (end - start).div_ceil(COLUMNS).max(1);
    let mut out = Vec::with_capacity(4 * COLUMNS as usize);
    let mut i = 0;
    while i < points.len() {
        let col = points[i].0.saturating_sub(start) / width;
        let mut j = i;
        let (mut lo, mut hi) = (i, i);
        while j < points.len() && points[j].0.saturating_sub(start) / width == col {
            if points[j].1 < points[lo].1 {
                lo = j;
            }
            if points[j].1 > points[hi].1 {
                hi = j;
            }
            j += 1;
        }
        let mut keep = [i, lo, hi, j - 1];
        keep.sort_unstable();
        let mut last = None;
        for k in keep {
            if last != Some(k) {
                out.push(points[k]);
                last = Some(k);
            }
        }
        i = j;
    }
    out
}

/// A series' colour, fixed per design so every chart reads alike.
pub fn colour(design: Design) -> RGBColor {
    match design {
        Design::Central => RGBColor(0x1F, 0x77, 0xB4),
        Design::Local => RGBColor(0xD6, 0x27, 0x28),
        Design::Shares => RGBColor(0x2C, 0xA0, 0x2C),
        Design::Lease => RGBColor(0x94, 0x67, 0xBD),
        Design::Edge => RGBColor(0xFF, 0x7F, 0x0E),
    }
}

/// Everything one `--plot` file shows.
pub struct Chart<'a> {
    /// Such as "600/60s burst 20, token-bucket, 20 gateways".
    pub subject: String,
    pub designs: &'a [Design],
    pub admitted: Admitted,
    /// The key, and per design a legend label and its bucket's trace.
    pub tokens: Option<(String, Vec<(String, TokenTrace)>)>,
}

const WIDTH: u32 = 1000;
const PANEL: u32 = 520;
const FONT: &str = "sans-serif";

fn register_font() -> Result<(), ReplayError> {
    static DONE: OnceLock<bool> = OnceLock::new();
    let ok = *DONE.get_or_init(|| {
        plotters::style::register_font(FONT, FontStyle::Normal, epaint_default_fonts::UBUNTU_LIGHT).is_ok()
    });
    if ok {
        Ok(())
    } else {
        Err(setting("--plot", "the compiled-in font could not be read"))
    }
}

impl Chart<'_> {
    /// Draws the chart into `path`, as its extension says.
    pub fn write(&self, path: &Path) -> Result<(), ReplayError> {
        let format = Format::of(path)?;
        register_font()?;
        let height = if self.tokens.is_some() { 2 * PANEL } else { PANEL };
        let failed = |e: String| ReplayError::Io {
            what: format!("cannot draw {}", path.display()),
            reason: e,
        };
        let bytes = match format {
            Format::Svg => {
                let mut svg = String::new();
                {
                    let root = SVGBackend::with_string(&mut svg, (WIDTH, height)).into_drawing_area();
                    self.draw(&root).map_err(failed)?;
                    root.present().map_err(|e| failed(e.to_string()))?;
                }
                svg.into_bytes()
            }
            Format::Png => {
                let mut rgb = vec![0u8; WIDTH as usize * height as usize * 3];
                {
                    let root = BitMapBackend::with_buffer(&mut rgb, (WIDTH, height)).into_drawing_area();
                    self.draw(&root).map_err(failed)?;
                    root.present().map_err(|e| failed(e.to_string()))?;
                }
                encode_png(&rgb, WIDTH, height).map_err(|e| failed(e.to_string()))?
            }
        };
        std::fs::write(path, bytes).map_err(|e| ReplayError::Io {
            what: format!("cannot write {}", path.display()),
            reason: e.to_string(),
        })
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<(), String> {
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        match &self.tokens {
            None => self.draw_admitted(root),
            Some((key, traces)) => {
                let (top, bottom) = root.split_vertically(PANEL);
                self.draw_admitted(&top)?;
                self.draw_tokens(&bottom, key, traces)
            }
        }
    }

    /// The chart's time span: the window's ends, or the rows' first and last times.
    fn span(&self) -> (u64, u64) {
        let a = &self.admitted;
        let start = a.window.from.or(a.first).unwrap_or(0);
        let end = a.window.to.or(a.last.map(|l| l + 1)).unwrap_or(start + 1);
        (start, end.max(start + 1))
    }

    fn draw_admitted<DB: DrawingBackend>(&self, area: &DrawingArea<DB, Shift>) -> Result<(), String> {
        let a = &self.admitted;
        let (start, end) = self.span();
        let axis = TimeAxis::new(start, end);
        let (first_bin, last_bin) = ((start - a.origin) / a.bin, (end - 1 - a.origin) / a.bin);
        let per_s = US_PER_S as f64 / a.bin as f64;
        let mut series = Vec::new();
        let mut top = 1.0f64;
        for (d, counts) in self.designs.iter().zip(&a.counts) {
            let mut pts = Vec::with_capacity(2 * (last_bin - first_bin + 1) as usize);
            for b in first_bin..=last_bin {
                let y = counts.get(&b).copied().unwrap_or(0) as f64 * per_s;
                top = top.max(y);
                let x0 = (a.origin + b * a.bin).max(start);
                let x1 = (a.origin + (b + 1) * a.bin).min(end);
                pts.push((axis.x(x0), y));
                pts.push((axis.x(x1), y));
            }
            series.push((*d, pts));
        }
        let bins = if a.bin == US_PER_S {
            String::new()
        } else {
            format!(" ({} bins)", duration(a.bin))
        };
        let title = format!("Admitted per second{bins}: {}", self.subject);
        let mut chart = frame(area, title, &axis, end, top, "admitted per second")?;
        let n = series.len();
        for (i, (d, pts)) in series.into_iter().enumerate() {
            let style = colour(d).stroke_width(stroke(pts.len(), i, n));
            chart
                .draw_series(LineSeries::new(pts, style))
                .map_err(|e| e.to_string())?
                .label(d.name())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], style));
        }
        legend(&mut chart)
    }

    fn draw_tokens<DB: DrawingBackend>(
        &self,
        area: &DrawingArea<DB, Shift>,
        key: &str,
        traces: &[(String, TokenTrace)],
    ) -> Result<(), String> {
        let (start, end) = self.span();
        let axis = TimeAxis::new(start, end);
        let mut top = 1.0f64;
        let mut series = Vec::new();
        for ((label, trace), d) in traces.iter().zip(self.designs) {
            let scale = trace.params.scale as f64;
            top = top.max(trace.params.burst as f64);
            let pts: Vec<(f64, f64)> = thin(trace.points(start, end), start, end)
                .into_iter()
                .map(|(t, u)| (axis.x(t), u as f64 / scale))
                .collect();
            series.push((label.as_str(), *d, pts));
        }
        let mut chart = frame(
            area,
            format!("Tokens in {key}'s bucket"),
            &axis,
            end,
            top,
            "tokens",
        )?;
        let n = series.len();
        for (i, (label, d, pts)) in series.into_iter().enumerate() {
            let style = colour(d).stroke_width(stroke(pts.len(), i, n));
            chart
                .draw_series(LineSeries::new(pts, style))
                .map_err(|e| e.to_string())?
                .label(label)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], style));
        }
        legend(&mut chart)
    }
}

/// A panel's chart as both panels draw it: title, time axis, value axis from 0 to a little
/// above `top`, light grid.
fn frame<'a, DB: DrawingBackend>(
    area: &'a DrawingArea<DB, Shift>,
    title: String,
    axis: &TimeAxis,
    end: u64,
    top: f64,
    y_desc: &str,
) -> Result<Panel<'a, DB>, String> {
    let mut chart = ChartBuilder::on(area)
        .caption(title, (FONT, 22))
        .margin(14)
        .x_label_area_size(46)
        .y_label_area_size(64)
        .build_cartesian_2d(0.0..axis.x(end), 0.0..top * 1.12)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc(axis.desc())
        .y_desc(y_desc)
        .label_style((FONT, 14))
        .axis_desc_style((FONT, 16))
        .light_line_style(RGBColor(0xEE, 0xEE, 0xEE))
        .x_label_formatter(&tick)
        .y_label_formatter(&tick)
        .draw()
        .map_err(|e| e.to_string())?;
    Ok(chart)
}

type Panel<'a, DB> = ChartContext<'a, DB, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// The legend of a panel's series, in its upper right corner.
fn legend<'a, DB: DrawingBackend + 'a>(chart: &mut Panel<'a, DB>) -> Result<(), String> {
    chart
        .configure_series_labels()
        .label_font((FONT, 16))
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK.mix(0.4))
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(|e| e.to_string())
}

/// The x axis: time after the chart's start, in seconds, or milliseconds for spans up to 2 s.
struct TimeAxis {
    start: u64,
    per_unit: f64,
    unit: &'static str,
}

impl TimeAxis {
    fn new(start: u64, end: u64) -> TimeAxis {
        let (per_unit, unit) = if end - start <= 2 * US_PER_S {
            (1_000.0, "milliseconds")
        } else {
            (US_PER_S as f64, "seconds")
        };
        TimeAxis {
            start,
            per_unit,
            unit,
        }
    }

    fn x(&self, t: u64) -> f64 {
        t.saturating_sub(self.start) as f64 / self.per_unit
    }

    fn desc(&self) -> String {
        // Traces made by the generator or from a day's logs count seconds since midnight: say
        // the clock time too, which is how people read a morning's timeline.
        let at = format_time_us(self.start);
        if self.start < 86_400 * US_PER_S {
            let s = self.start / US_PER_S;
            format!(
                "{} after {:02}:{:02}:{:02}.{:03} (trace time {at})",
                self.unit,
                s / 3600,
                s / 60 % 60,
                s % 60,
                self.start % US_PER_S / 1_000
            )
        } else {
            format!("{} after trace time {at}", self.unit)
        }
    }
}

/// The width of series `i` of `n`. Designs often agree for a while (every design admits all
/// of a quiet minute), so each line is drawn 2 px wider than the next, and one that another
/// covers still shows at its edges. Lines of more points than the chart has pixels across are
/// 1 px: the bitmap backend draws a wider line as a polygon whose mitres shoot out at a
/// sawtooth's sharp turns.
fn stroke(points: usize, i: usize, n: usize) -> u32 {
    if points > WIDTH as usize {
        1
    } else {
        2 + 2 * (n - 1 - i) as u32
    }
}

/// `50`, not `50.0`; `0.25` where the axis needs it.
fn tick(v: &f64) -> String {
    let s = format!("{v:.3}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// `10ms`, `200ms`, `1s`, `500us`.
fn duration(us: u64) -> String {
    if us.is_multiple_of(US_PER_S) {
        format!("{}s", us / US_PER_S)
    } else if us.is_multiple_of(1_000) {
        format!("{}ms", us / 1_000)
    } else {
        format!("{us}us")
    }
}

fn encode_png(rgb: &[u8], width: u32, height: u32) -> Result<Vec<u8>, png::EncodingError> {
    let mut out = Vec::new();
    let mut enc = png::Encoder::new(&mut out, width, height);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    let mut w = enc.write_header()?;
    w.write_image_data(rgb)?;
    w.finish()?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tollgate_limit::bucket::Rate;

    #[test]
    fn windows_parse_trace_times_and_durations() {
        assert_eq!(
            Window::parse("32400..+300ms"),
            Ok(Window {
                from: Some(32_400_000_000),
                to: Some(32_400_300_000)
            })
        );
        assert_eq!(
            Window::parse("..32400.5"),
            Ok(Window {
                from: None,
                to: Some(32_400_500_000)
            })
        );
        assert_eq!(Window::parse(".."), Ok(Window::default()));
        assert!(Window::parse("32400").unwrap_err().contains("FROM..TO"));
        assert!(Window::parse("5..4").unwrap_err().contains("end after it starts"));
        assert!(Window::parse("..+1s").unwrap_err().contains("FROM is needed"));
        assert!(Window::parse("1..+1h").unwrap_err().contains("unknown unit"));
    }

    #[test]
    fn short_windows_get_finer_bins() {
        let w = |f: u64, t: u64| Window {
            from: Some(f),
            to: Some(t),
        };
        assert_eq!(w(0, 300_000).bin_us(), 10_000);
        assert_eq!(w(0, 10 * US_PER_S).bin_us(), 200_000);
        assert_eq!(w(0, 120 * US_PER_S).bin_us(), US_PER_S);
        assert_eq!(w(0, 10).bin_us(), 1);
        assert_eq!(Window::default().bin_us(), US_PER_S);
    }

    #[test]
    fn extensions_pick_the_format() {
        assert_eq!(Format::of(Path::new("a/b.SVG")), Ok(Format::Svg));
        assert_eq!(Format::of(Path::new("b.png")), Ok(Format::Png));
        let e = Format::of(Path::new("b.jpg")).unwrap_err().to_string();
        assert!(e.contains("--plot") && e.contains("\".jpg\""), "{e}");
        assert!(
            Format::of(Path::new("chart"))
                .unwrap_err()
                .to_string()
                .contains("no extension")
        );
    }

    #[test]
    fn long_token_lines_keep_each_columns_extremes() {
        let saw: Vec<(u64, u64)> = (0..100_000u64).map(|t| (t, t % 7)).collect();
        let thin = thin(saw.clone(), 0, 100_000);
        assert!(thin.len() <= 4 * COLUMNS as usize, "{}", thin.len());
        assert!(thin.windows(2).all(|w| w[0].0 <= w[1].0));
        assert_eq!((thin[0], thin[thin.len() - 1]), (saw[0], saw[99_999]));
        // Every column still spans the whole sawtooth, 0 to 6.
        let col = &thin[..4];
        assert_eq!(col.iter().map(|p| p.1).min(), Some(0));
        assert_eq!(col.iter().map(|p| p.1).max(), Some(6));
        let short: Vec<(u64, u64)> = (0..10).map(|t| (t, t)).collect();
        assert_eq!(super::thin(short.clone(), 0, 10), short);
    }

    #[test]
    fn token_lines_refill_to_a_corner_and_step_at_checks() {
        // 10/s, burst 2: scale 100,000 units per token, 1 unit per µs.
        let p = BucketParams::new(Rate::parse("10/1s").unwrap(), 2).unwrap();
        let mut t = TokenTrace::new(p, Window::default());
        t.record(0, 200_000, 100_000);
        t.record(0, 100_000, 0);
        let pts = t.points(0, 300_000);
        assert_eq!(
            pts,
            vec![
                (0, 200_000),
                (0, 100_000),
                (0, 0),
                (200_000, 200_000),
                (300_000, 200_000)
            ]
        );
        // Entering a window: the state before it, refilled to its start.
        let mut w = TokenTrace::new(
            p,
            Window {
                from: Some(50_000),
                to: None,
            },
        );
        w.record(0, 200_000, 0);
        assert_eq!(w.points(50_000, 60_000), vec![(50_000, 50_000), (60_000, 60_000)]);
    }
}
