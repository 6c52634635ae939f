//! PNG line charts (plotters) of training curves.

use std::path::Path;

use anyhow::Context as _;
use plotters::prelude::*;

/// One line of a chart; `band` (same length as `points`) draws a shaded
/// min..max range around it (e.g. the spread over seeds).
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
    pub band: Option<Vec<(f64, f64)>>,
}

/// Draws `series` into a PNG at `path`.
pub fn line_chart(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
) -> anyhow::Result<()> {
    let root = BitMapBackend::new(path, (960, 600)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow::anyhow!("{e}"))?;
    draw_chart(&root, title, x_label, y_label, series)
        .with_context(|| format!("nothing to plot for {}", path.display()))?;
    root.present()
        .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?;
    Ok(())
}

/// One PNG of several charts side by side (two per row), each `(title,
/// series)`; all share the axes' labels.
pub fn panel_chart(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    panels: &[(String, Vec<Series>)],
) -> anyhow::Result<()> {
    let rows = panels.len().div_ceil(2).max(1);
    let cols = panels.len().clamp(1, 2);
    let root =
        BitMapBackend::new(path, (720 * cols as u32, 480 * rows as u32 + 40)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow::anyhow!("{e}"))?;
    let body = root
        .titled(title, ("sans-serif", 28))
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    for (area, (name, series)) in body.split_evenly((rows, cols)).iter().zip(panels) {
        draw_chart(area, name, x_label, y_label, series)
            .with_context(|| format!("panel {name} of {}", path.display()))?;
    }
    root.present()
        .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?;
    Ok(())
}

fn draw_chart<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
) -> anyhow::Result<()> {
    let xs = series.iter().flat_map(|s| s.points.iter().map(|p| p.0));
    let (x0, x1) = xs.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), x| {
        (a.min(x), b.max(x))
    });
    let ys = series.iter().flat_map(|s| {
        s.points
            .iter()
            .map(|p| p.1)
            .chain(s.band.iter().flatten().flat_map(|b| [b.0, b.1]))
    });
    let (y0, y1) = ys.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), y| {
        (a.min(y), b.max(y))
    });
    if !x0.is_finite() || !y0.is_finite() {
        anyhow::bail!("no finite point");
    }
    let pad = ((y1 - y0) * 0.05).max(1e-3);
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 24))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(60)
        .build_cartesian_2d(x0..x1.max(x0 + 1e-9), (y0 - pad)..(y1 + pad))
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc(y_label)
        .draw()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    for (i, s) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        if let Some(band) = &s.band {
            let upper = s.points.iter().zip(band).map(|(p, b)| (p.0, b.1));
            let lower = s.points.iter().zip(band).rev().map(|(p, b)| (p.0, b.0));
            let poly: Vec<(f64, f64)> = upper.chain(lower).collect();
            chart
                .draw_series(std::iter::once(Polygon::new(
                    poly,
                    color.mix(0.15).filled(),
                )))
                .map_err(|e| anyhow::anyhow!("{e}"))?;
        }
        chart
            .draw_series(LineSeries::new(
                s.points.iter().copied(),
                color.stroke_width(2),
            ))
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .label(s.name.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(())
}

/// A moving average over `window` points (for noisy per-step rewards).
pub fn smooth(points: &[(f64, f64)], window: usize) -> Vec<(f64, f64)> {
    let w = window.max(1);
    points
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let lo = i.saturating_sub(w - 1);
            let slice = &points[lo..=i];
            (
                p.0,
                slice.iter().map(|q| q.1).sum::<f64>() / slice.len() as f64,
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smoothing_is_a_trailing_mean() {
        let pts = vec![(0.0, 0.0), (1.0, 3.0), (2.0, 6.0)];
        assert_eq!(smooth(&pts, 2), vec![(0.0, 0.0), (1.0, 1.5), (2.0, 4.5)]);
    }

    #[test]
    fn writes_a_png() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.png");
        let s = Series {
            name: "a".into(),
            points: vec![(0.0, 0.1), (1.0, 0.4)],
            band: Some(vec![(0.0, 0.2), (0.3, 0.5)]),
        };
        line_chart(&path, "t", "x", "y", std::slice::from_ref(&s)).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[1..4], b"PNG");
        let panels = path.with_file_name("p.png");
        let three: Vec<(String, Vec<Series>)> = (0..3)
            .map(|i| {
                let s = Series {
                    name: "a".into(),
                    points: s.points.clone(),
                    band: s.band.clone(),
                };
                (format!("panel {i}"), vec![s])
            })
            .collect();
        panel_chart(&panels, "t", "x", "y", &three).unwrap();
        assert_eq!(&std::fs::read(&panels).unwrap()[1..4], b"PNG");
    }
}
