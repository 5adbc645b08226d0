//! `--plot out.png`: GB/s and µs per request against size, one request in flight, kvlink
//! beside ucx_perftest; one pair of panels per transport. Text is drawn with the DejaVu Sans
//! font embedded in the binary, so no system font is needed.
use crate::report::{Kind, Row};
use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};
use std::error::Error;
use std::path::Path;

const FONT: &str = "sans-serif";

struct Series {
    kind: Kind,
    color: RGBColor,
}

const GBPS: [Series; 3] = [
    Series {
        kind: Kind::KvlinkRequest,
        color: RGBColor(31, 119, 180),
    },
    Series {
        kind: Kind::KvlinkTransport,
        color: RGBColor(44, 160, 44),
    },
    Series {
        kind: Kind::UcxTagBw,
        color: RGBColor(214, 39, 40),
    },
];

const MICROS: [Series; 4] = [
    Series {
        kind: Kind::KvlinkRequest,
        color: RGBColor(31, 119, 180),
    },
    Series {
        kind: Kind::KvlinkTransport,
        color: RGBColor(44, 160, 44),
    },
    Series {
        kind: Kind::UcxTagBw,
        color: RGBColor(214, 39, 40),
    },
    Series {
        kind: Kind::UcxTagLat,
        color: RGBColor(255, 127, 14),
    },
];

fn short_size(log2: f64) -> String {
    let e = log2.round();
    if (log2 - e).abs() > 1e-6 || !(0.0..63.0).contains(&e) {
        return String::new();
    }
    let n = 1u64 << e as u32;
    match n {
        n if n >= 1 << 30 => format!("{}G", n >> 30),
        n if n >= 1 << 20 => format!("{}M", n >> 20),
        n if n >= 1 << 10 => format!("{}K", n >> 10),
        n => n.to_string(),
    }
}

/// One kind's points on a panel.
type Line = (Kind, RGBColor, Vec<(f64, f64)>);

/// (log2 size, value) of one kind's single-request rows, by size.
fn points(rows: &[Row], tl: &str, kind: Kind, value: fn(&Row) -> Option<f64>) -> Vec<(f64, f64)> {
    let mut p: Vec<(f64, f64)> = rows
        .iter()
        .filter(|r| r.transport == tl && r.kind == kind && r.in_flight == 1)
        .filter_map(|r| {
            value(r)
                .filter(|v| *v > 0.0)
                .map(|v| ((r.size as f64).log2(), v))
        })
        .collect();
    p.sort_by(|a, b| a.0.total_cmp(&b.0));
    p
}

fn label(kind: Kind, micros: bool) -> &'static str {
    match (kind, micros) {
        (Kind::KvlinkRequest, false) => "kvlink whole requests",
        (Kind::KvlinkRequest, true) => "kvlink whole request (p50)",
        (Kind::KvlinkTransport, false) => "kvlink transport",
        (Kind::KvlinkTransport, true) => "kvlink transport, per transfer (p50)",
        (Kind::UcxTagBw, false) => "ucx_perftest tag_bw -O 1",
        (Kind::UcxTagBw, true) => "ucx_perftest tag_bw -O 1, per message",
        (Kind::UcxTagLat, _) => "ucx_perftest tag_lat, one-way",
    }
}

pub fn draw(path: &Path, rows: &[Row]) -> Result<(), Box<dyn Error>> {
    register_font(FONT, FontStyle::Normal, dejavu::sans::regular())
        .map_err(|_| "the embedded font was not accepted")?;
    let mut transports: Vec<&str> = Vec::new();
    for r in rows {
        if !transports.contains(&r.transport.as_str()) {
            transports.push(&r.transport);
        }
    }
    if transports.is_empty() {
        return Err("nothing to plot".into());
    }
    let (w, h) = (1400u32, 60 + 480 * transports.len() as u32);
    let root = BitMapBackend::new(path, (w, h)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(
        "kvlink-bench: two processes on loopback, one request in flight (same run as ucx_perftest)",
        (FONT, 22),
    )?;
    let panels = root.split_evenly((transports.len(), 2));
    for (i, tl) in transports.iter().enumerate() {
        let sizes: Vec<f64> = rows
            .iter()
            .filter(|r| r.transport == *tl && r.in_flight == 1)
            .map(|r| (r.size as f64).log2())
            .collect();
        let lo = sizes.iter().copied().fold(f64::INFINITY, f64::min).floor() - 0.5;
        let hi = sizes
            .iter()
            .copied()
            .fold(f64::NEG_INFINITY, f64::max)
            .ceil()
            + 0.5;
        let (lo, hi) = if lo.is_finite() && hi > lo {
            (lo, hi)
        } else {
            (10.0, 27.0)
        };

        // GB/s, linear.
        let gb: Vec<Line> = GBPS
            .iter()
            .map(|s| (s.kind, s.color, points(rows, tl, s.kind, |r| r.gbps)))
            .collect();
        let top = gb
            .iter()
            .flat_map(|(_, _, p)| p.iter().map(|x| x.1))
            .fold(0.0, f64::max)
            .max(0.1)
            * 1.15;
        let mut chart = ChartBuilder::on(&panels[2 * i])
            .caption(format!("{tl}: GB/s against size"), (FONT, 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(55)
            .build_cartesian_2d(lo..hi, 0.0..top)?;
        chart
            .configure_mesh()
            .x_desc("bytes per request")
            .y_desc("GB/s (1e9 bytes/s)")
            .x_labels(((hi - lo) as usize).max(2) + 1)
            .x_label_formatter(&|x| short_size(*x))
            .label_style((FONT, 13))
            .light_line_style(WHITE)
            .draw()?;
        for (kind, color, p) in &gb {
            if p.is_empty() {
                continue;
            }
            let c = *color;
            chart
                .draw_series(LineSeries::new(p.clone(), c.stroke_width(2)))?
                .label(label(*kind, false))
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2))
                });
            chart.draw_series(p.iter().map(|&xy| Circle::new(xy, 4, c.filled())))?;
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font((FONT, 13))
            .position(SeriesLabelPosition::UpperLeft)
            .draw()?;

        // µs per request, log scale.
        let us: Vec<Line> = MICROS
            .iter()
            .map(|s| (s.kind, s.color, points(rows, tl, s.kind, |r| r.us_p50)))
            .collect();
        let vals: Vec<f64> = us
            .iter()
            .flat_map(|(_, _, p)| p.iter().map(|x| x.1))
            .collect();
        let ymin = vals.iter().copied().fold(f64::INFINITY, f64::min);
        let ymax = vals.iter().copied().fold(0.0, f64::max);
        let (ymin, ymax) = if ymin.is_finite() && ymax > 0.0 {
            (ymin / 2.0, ymax * 2.0)
        } else {
            (1.0, 1e6)
        };
        let mut chart = ChartBuilder::on(&panels[2 * i + 1])
            .caption(format!("{tl}: µs per request against size"), (FONT, 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(65)
            .build_cartesian_2d(lo..hi, (ymin..ymax).log_scale())?;
        chart
            .configure_mesh()
            .x_desc("bytes per request")
            .y_desc("µs per request (log scale)")
            .x_labels(((hi - lo) as usize).max(2) + 1)
            .x_label_formatter(&|x| short_size(*x))
            .y_label_formatter(&|y| crate::report::sig3(*y))
            .label_style((FONT, 13))
            .light_line_style(WHITE)
            .draw()?;
        for (kind, color, p) in &us {
            if p.is_empty() {
                continue;
            }
            let c = *color;
            chart
                .draw_series(LineSeries::new(p.clone(), c.stroke_width(2)))?
                .label(label(*kind, true))
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2))
                });
            chart.draw_series(p.iter().map(|&xy| Circle::new(xy, 4, c.filled())))?;
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font((FONT, 13))
            .position(SeriesLabelPosition::LowerRight)
            .draw()?;
    }
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_ticks() {
        assert_eq!(short_size(12.0), "4K");
        assert_eq!(short_size(20.0), "1M");
        assert_eq!(short_size(26.0), "64M");
        assert_eq!(short_size(12.5), "");
    }

    #[test]
    fn draws_a_png_without_system_fonts() {
        let mut rows = Vec::new();
        for (i, size) in [4096u64, 1 << 20, 16 << 20].into_iter().enumerate() {
            for kind in [
                Kind::UcxTagBw,
                Kind::UcxTagLat,
                Kind::KvlinkTransport,
                Kind::KvlinkRequest,
            ] {
                let mut r = Row::new("tcp", kind, size, 1);
                r.gbps = Some(1.0 + i as f64);
                r.us_p50 = Some(10.0 * (i + 1) as f64);
                rows.push(r);
            }
        }
        let path =
            std::env::temp_dir().join(format!("kvlink-bench-plot-{}.png", std::process::id()));
        draw(&path, &rows).expect("plot");
        let bytes = std::fs::read(&path).expect("png written");
        let _ = std::fs::remove_file(&path);
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    }
}
