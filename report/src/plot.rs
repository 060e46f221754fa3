//! Line charts against the context length (log2 axis) or a linear axis as PNGs, drawn with
//! plotters' bitmap back end into memory, encoded with the `png` crate; text with the embedded
//! DejaVu Sans (a subset) through ab_glyph (no system fonts, no fontconfig).

use std::fmt::Write as _;
use std::fs::File;
use std::io::BufWriter;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Once;

use plotters::coord::ranged1d::{AsRangedCoord, Ranged, ValueFormatter};
use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;

/// DejaVu Sans, the subset `fonts/README.md` says how to make (license: `fonts/LICENSE-DejaVu`).
static FONT: &[u8] = include_bytes!("../fonts/DejaVuSans-subset.ttf");
const FAMILY: &str = "sans-serif";

fn register_font() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        if plotters::style::register_font(FAMILY, FontStyle::Normal, FONT).is_err() {
            panic!("the embedded font does not parse");
        }
    });
}

/// Colours of the series, in order.
pub const COLORS: [RGBColor; 7] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(127, 127, 127),
];

pub struct Series {
    pub label: String,
    /// (context or tokens, value); points without a measurement are left out.
    pub points: Vec<(f64, f64)>,
    pub color: RGBColor,
    pub dashed: bool,
}

impl Series {
    pub fn new(label: impl Into<String>, points: Vec<(f64, f64)>, color: usize) -> Self {
        Series {
            label: label.into(),
            points,
            color: COLORS[color % COLORS.len()],
            dashed: false,
        }
    }

    pub fn dashed(mut self) -> Self {
        self.dashed = true;
        self
    }
}

pub struct Panel {
    pub title: String,
    /// A log2 x axis labelled in tokens (`4K`, `256K`) when true; a linear one otherwise.
    pub log_x: bool,
    pub x_desc: String,
    pub y_desc: String,
    pub log_y: bool,
    /// The bottom of a linear y axis [default: 0, or below the lowest value when one is
    /// negative].
    pub y_min: Option<f64>,
    /// The x values the axis spans (the cases' contexts), measured or not.
    pub x_span: Vec<f64>,
    pub series: Vec<Series>,
    /// Horizontal lines (label, y): ceilings.
    pub hlines: Vec<Series>,
    /// Where the legend goes (away from where the data is).
    pub legend: SeriesLabelPosition,
}

/// Draws `panels` side by side into the PNG `path`, under `caption`.
pub fn draw(path: &Path, caption: &str, panels: &[Panel]) -> Result<(), String> {
    register_font();
    let (width, height) = (120 + 620 * panels.len().max(1) as u32, 520);
    let mut rgb = vec![0u8; width as usize * height as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut rgb, (width, height)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let root = root
            .titled(caption, (FAMILY, 24))
            .map_err(|e| e.to_string())?;
        let areas = root.split_evenly((1, panels.len().max(1)));
        for (area, panel) in areas.iter().zip(panels) {
            draw_panel(area, panel)?;
        }
        root.present().map_err(|e| e.to_string())?;
    }
    write_png(path, width, height, &rgb).map_err(|e| format!("writing {}: {e}", path.display()))
}

/// `rgb` (8-bit RGB rows, top to bottom) as a PNG file.
fn write_png(
    path: &Path,
    width: u32,
    height: u32,
    rgb: &[u8],
) -> Result<(), Box<dyn std::error::Error>> {
    let mut encoder = png::Encoder::new(BufWriter::new(File::create(path)?), width, height);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    // Small files (a report's PNGs get committed): flat colours compress well.
    encoder.set_compression(png::Compression::Best);
    encoder.set_adaptive_filter(png::AdaptiveFilterType::Adaptive);
    let mut writer = encoder.write_header()?;
    writer.write_image_data(rgb)?;
    writer.finish()?;
    Ok(())
}

fn draw_panel<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, p: &Panel) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    let xs: Vec<f64> = p.x_span.iter().map(|&x| p.x_coord(x)).collect();
    let (x_lo, x_hi) = bounds(&xs).unwrap_or((12.0, 18.0));
    let pad = if p.log_x {
        0.3
    } else {
        (x_hi - x_lo).max(1.0) * 0.03
    };
    let x_range = (x_lo - pad)..(x_hi + pad);
    let ys: Vec<f64> = p
        .series
        .iter()
        .chain(&p.hlines)
        .flat_map(|s| s.points.iter().map(|&(_, y)| y))
        .filter(|y| y.is_finite() && (!p.log_y || *y > 0.0))
        .collect();
    let measured = !p.series.iter().all(|s| s.points.is_empty());
    let (y_lo, y_hi) = bounds(&ys).unwrap_or((1.0, 10.0));
    if p.log_y {
        let range = (y_lo / 1.6)..(y_hi * 1.6);
        draw_in(area, p, x_range, range.log_scale(), measured)
    } else {
        let lo = p
            .y_min
            .unwrap_or(if y_lo < 0.0 { y_lo * 1.15 } else { 0.0 });
        let hi = if y_hi > lo {
            y_hi + (y_hi - lo) * 0.15
        } else {
            lo + 1e-9
        };
        let range = lo..hi;
        draw_in(area, p, x_range, range, measured)
    }
}

impl Panel {
    /// Where `x` sits on the chart's axis.
    fn x_coord(&self, x: f64) -> f64 {
        if self.log_x {
            x.log2()
        } else {
            x
        }
    }
}

fn bounds(v: &[f64]) -> Option<(f64, f64)> {
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (lo.is_finite() && hi.is_finite()).then_some((lo, hi))
}

/// `4096` -> `4K`, `262144` -> `256K`, `1048576` -> `1M`.
pub fn tokens_label(n: f64) -> String {
    let n = n.round() as u64;
    if n >= 1 << 20 && n.is_multiple_of(1 << 20) {
        format!("{}M", n >> 20)
    } else if n >= 1024 && n.is_multiple_of(1024) {
        format!("{}K", n >> 10)
    } else {
        n.to_string()
    }
}

fn number_label(v: f64) -> String {
    let a = v.abs();
    if a == 0.0 {
        "0".into()
    } else if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
            .trim_end_matches('0')
            .trim_end_matches('.')
            .into()
    } else {
        format!("{v:.3}")
            .trim_end_matches('0')
            .trim_end_matches('.')
            .into()
    }
}

fn draw_in<DB, Y>(
    area: &DrawingArea<DB, Shift>,
    p: &Panel,
    x_range: Range<f64>,
    y_range: Y,
    measured: bool,
) -> Result<(), String>
where
    DB: DrawingBackend,
    DB::ErrorType: 'static,
    Y: AsRangedCoord<Value = f64>,
    Y::CoordDescType: Ranged<ValueType = f64> + ValueFormatter<f64>,
{
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    let (x0, x1) = (x_range.start, x_range.end);
    let mut chart = ChartBuilder::on(area)
        .caption(&p.title, (FAMILY, 20))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(70)
        .build_cartesian_2d::<RangedCoordf64, Y>(x_range.into(), y_range)
        .map_err(err)?;
    let log_x = p.log_x;
    let whole = |v: &f64| {
        if (v - v.round()).abs() >= 1e-6 {
            String::new()
        } else if log_x {
            tokens_label(2f64.powf(v.round()))
        } else {
            format!("{}", v.round())
        }
    };
    let x_labels = if log_x {
        ((x1 - x0).ceil() as usize + 1).max(2)
    } else {
        16
    };
    chart
        .configure_mesh()
        .x_labels(x_labels)
        .x_label_formatter(&whole)
        .y_labels(14)
        .y_label_formatter(&|v| number_label(*v))
        .x_desc(p.x_desc.as_str())
        .y_desc(p.y_desc.as_str())
        .label_style((FAMILY, 14))
        .axis_desc_style((FAMILY, 16))
        .light_line_style(RGBColor(235, 235, 235))
        .draw()
        .map_err(err)?;
    for s in &p.series {
        let pts: Vec<(f64, f64)> = s.points.iter().map(|&(x, y)| (p.x_coord(x), y)).collect();
        let color = s.color;
        let style = color.stroke_width(2);
        let legend = move |(x, y): (i32, i32)| PathElement::new(vec![(x, y), (x + 22, y)], style);
        if s.dashed {
            // The legend's sample dashed too: two strokes with a gap.
            let dashes = move |(x, y): (i32, i32)| {
                EmptyElement::at((x, y))
                    + PathElement::new(vec![(0, 0), (9, 0)], style)
                    + PathElement::new(vec![(14, 0), (22, 0)], style)
            };
            chart
                .draw_series(DashedLineSeries::new(pts.clone(), 8, 5, style))
                .map_err(err)?
                .label(s.label.as_str())
                .legend(dashes);
        } else {
            chart
                .draw_series(LineSeries::new(pts.clone(), style))
                .map_err(err)?
                .label(s.label.as_str())
                .legend(legend);
        }
        chart
            .draw_series(pts.iter().map(|&c| Circle::new(c, 4, color.filled())))
            .map_err(err)?;
    }
    for h in &p.hlines {
        if let Some(&(_, y)) = h.points.first() {
            let style = h.color.stroke_width(2);
            chart
                .draw_series(DashedLineSeries::new(vec![(x0, y), (x1, y)], 10, 6, style))
                .map_err(err)?
                .label(h.label.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 22, y)], style));
        }
    }
    if !p.series.is_empty() || !p.hlines.is_empty() {
        chart
            .configure_series_labels()
            .label_font((FAMILY, 14))
            .background_style(WHITE.mix(0.85))
            .border_style(RGBColor(180, 180, 180))
            .position(p.legend.clone())
            .draw()
            .map_err(err)?;
    }
    if !measured {
        let (w, h) = area.dim_in_pixel();
        area.draw(&Text::new(
            "not measured",
            (w as i32 / 2 - 60, h as i32 / 2),
            (FAMILY, 22).into_font().color(&RGBColor(200, 0, 0)),
        ))
        .map_err(err)?;
    }
    Ok(())
}

/// Links `pngs` (by file name, each its own paragraph) at the end of `md` and writes it to
/// `out/REPORT.md`; returns that path.
pub fn write_markdown(out: &Path, mut md: String, pngs: &[PathBuf]) -> Result<PathBuf, String> {
    for p in pngs {
        let name = p
            .file_name()
            .map_or(String::new(), |n| n.to_string_lossy().into());
        let _ = writeln!(md, "![{name}]({name})\n");
    }
    let markdown = out.join("REPORT.md");
    std::fs::write(&markdown, md).map_err(|e| format!("{}: {e}", markdown.display()))?;
    Ok(markdown)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels() {
        assert_eq!(tokens_label(4096.0), "4K");
        assert_eq!(tokens_label(262144.0), "256K");
        assert_eq!(tokens_label(1048576.0), "1M");
        assert_eq!(tokens_label(100.0), "100");
        assert_eq!(number_label(12.5), "12.5");
        assert_eq!(number_label(0.25), "0.25");
        assert_eq!(number_label(2000.0), "2000");
    }
}
