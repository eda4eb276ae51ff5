//! The context-tokens chart: tokens sent per turn with compaction and without, with
//! compaction events marked. SVG from plotters' own backend: no system fonts, no C
//! libraries.

use std::path::Path;

use anyhow::Context as _;
use plotters::prelude::*;

/// One turn of the chart.
#[derive(Debug, Clone, Copy)]
pub struct Turn {
    /// The model call's number (1-based).
    pub turn: u64,
    /// Prompt tokens with keel's compaction.
    pub compacted: u64,
    /// Prompt tokens the full history would have taken.
    pub full: u64,
}

/// A compaction to mark.
#[derive(Debug, Clone, Copy)]
pub struct Mark {
    /// The turn it happened before.
    pub turn: u64,
    /// An epoch (true) or a milestone.
    pub epoch: bool,
}

const COMPACTED: RGBColor = RGBColor(0x1f, 0x77, 0xb4);
const FULL: RGBColor = RGBColor(0xd6, 0x27, 0x28);
const MILESTONE: RGBColor = RGBColor(0x99, 0x99, 0x99);
const EPOCH: RGBColor = RGBColor(0x2c, 0xa0, 0x2c);
const MASK: RGBColor = RGBColor(0xff, 0x7f, 0x0e);

/// Writes the chart to `path` as SVG.
pub fn write_svg(path: &Path, title: &str, turns: &[Turn], marks: &[Mark]) -> anyhow::Result<()> {
    write_svg_with_masks(path, title, turns, marks, &[])
}

/// [`write_svg`], with the turns before which old tool results were masked (observation
/// masking: neither a milestone nor an epoch) marked and named apart.
pub fn write_svg_with_masks(
    path: &Path,
    title: &str,
    turns: &[Turn],
    marks: &[Mark],
    masks: &[u64],
) -> anyhow::Result<()> {
    let svg = render_svg_with_masks(title, turns, marks, masks)?;
    prepare(path)?;
    std::fs::write(path, svg)
        .with_context(|| format!("cannot write the chart to {}", path.display()))
}

/// Makes ready to write the chart at `path`: its directory is created, and a path that
/// is a directory refused. Called before a long replay, so a bad `--chart` fails first.
pub fn prepare(path: &Path) -> anyhow::Result<()> {
    if path.is_dir() {
        anyhow::bail!(
            "cannot write the chart to {}: it is a directory; give a file name ending in .svg",
            path.display()
        );
    }
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => {
            crate::ui::create_dir(dir, "the chart's directory")
        }
        _ => Ok(()),
    }
}

/// The chart as an SVG document (what [`write_svg`] writes).
#[cfg(test)]
pub fn render_svg(title: &str, turns: &[Turn], marks: &[Mark]) -> anyhow::Result<String> {
    render_svg_with_masks(title, turns, marks, &[])
}

/// The chart as an SVG document, with masking marked ([`write_svg_with_masks`]).
pub fn render_svg_with_masks(
    title: &str,
    turns: &[Turn],
    marks: &[Mark],
    masks: &[u64],
) -> anyhow::Result<String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (960, 520)).into_drawing_area();
        draw(&root, title, turns, marks, masks)
            .map_err(|e| anyhow::anyhow!("cannot draw the chart: {e}"))?;
        root.present()
            .map_err(|e| anyhow::anyhow!("cannot finish the chart: {e}"))?;
    }
    Ok(svg)
}

fn draw<DB: DrawingBackend>(
    root: &DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    turns: &[Turn],
    marks: &[Mark],
    masks: &[u64],
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    root.fill(&WHITE)?;
    let last = turns.last().map_or(1, |t| t.turn.max(1));
    let top = turns
        .iter()
        .map(|t| t.full.max(t.compacted))
        .max()
        .unwrap_or(1)
        .max(1);
    let top = top + top / 10;
    let mut chart = ChartBuilder::on(root)
        .caption(title, ("sans-serif", 20))
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0u64..last + 1, 0u64..top)?;
    chart
        .configure_mesh()
        .x_desc("turn (model call)")
        .y_desc("prompt tokens")
        .light_line_style(WHITE.mix(0.0))
        .draw()?;
    for m in marks {
        let color = if m.epoch { EPOCH } else { MILESTONE };
        chart.draw_series(std::iter::once(PathElement::new(
            vec![(m.turn, 0), (m.turn, top)],
            color.mix(if m.epoch { 0.8 } else { 0.5 }).stroke_width(1),
        )))?;
    }
    for &turn in masks {
        chart.draw_series(std::iter::once(PathElement::new(
            vec![(turn, 0), (turn, top)],
            MASK.mix(0.6).stroke_width(1),
        )))?;
    }
    chart
        .draw_series(LineSeries::new(
            turns.iter().map(|t| (t.turn, t.full)),
            FULL.stroke_width(2),
        ))?
        .label("full history (no compaction)")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], FULL.stroke_width(2)));
    chart
        .draw_series(LineSeries::new(
            turns.iter().map(|t| (t.turn, t.compacted)),
            COMPACTED.stroke_width(2),
        ))?
        .label("keel (compacted)")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], COMPACTED.stroke_width(2)));
    if marks.iter().any(|m| !m.epoch) {
        chart
            .draw_series(std::iter::empty::<PathElement<(u64, u64)>>())?
            .label("milestone")
            .legend(|(x, y)| PathElement::new(vec![(x + 10, y - 6), (x + 10, y + 6)], MILESTONE));
    }
    if marks.iter().any(|m| m.epoch) {
        chart
            .draw_series(std::iter::empty::<PathElement<(u64, u64)>>())?
            .label("epoch summary")
            .legend(|(x, y)| PathElement::new(vec![(x + 10, y - 6), (x + 10, y + 6)], EPOCH));
    }
    if !masks.is_empty() {
        chart
            .draw_series(std::iter::empty::<PathElement<(u64, u64)>>())?
            .label("tool results masked")
            .legend(|(x, y)| PathElement::new(vec![(x + 10, y - 6), (x + 10, y + 6)], MASK));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK.mix(0.3))
        .draw()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_both_lines_and_the_marks() {
        let turns: Vec<Turn> = (1..=200)
            .map(|t| Turn {
                turn: t,
                compacted: 1_000 + (t % 10) * 300,
                full: 1_000 + t * 300,
            })
            .collect();
        let marks = [
            Mark {
                turn: 10,
                epoch: false,
            },
            Mark {
                turn: 50,
                epoch: true,
            },
        ];
        let svg = render_svg("test", &turns, &marks).unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..svg.len().min(100)]);
        assert!(svg.contains("full history (no compaction)"));
        assert!(svg.contains("keel (compacted)"));
        assert!(svg.contains("epoch summary"));
        assert!(svg.matches("<polyline").count() >= 2, "two series");
    }

    #[test]
    fn masking_is_marked_as_masking_not_as_a_milestone() {
        let turns: Vec<Turn> = (1..=20)
            .map(|t| Turn {
                turn: t,
                compacted: 500 + t * 10,
                full: 500 + t * 100,
            })
            .collect();
        let svg = render_svg_with_masks("masking", &turns, &[], &[5, 12]).unwrap();
        assert!(svg.contains("tool results masked"), "{svg}");
        assert!(!svg.contains("milestone"), "no milestone was made: {svg}");
        assert!(!svg.contains("epoch summary"), "{svg}");
        let plain = render_svg("masking", &turns, &[]).unwrap();
        assert!(!plain.contains("tool results masked"));
    }

    #[test]
    fn an_empty_run_still_makes_a_chart() {
        let svg = render_svg("empty", &[], &[]).unwrap();
        assert!(svg.contains("</svg>"));
    }
}
