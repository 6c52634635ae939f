//! Reading the learner's `learner_metrics.csv` back (curves, benches).

use std::path::Path;

use anyhow::Context as _;

/// The values of `columns` (in that order) of every data row of `csv`; a
/// field that is missing or not a number reads as NaN. A column the header
/// lacks is an error naming it.
pub fn read_columns(csv: &Path, columns: &[&str]) -> anyhow::Result<Vec<Vec<f64>>> {
    let text =
        std::fs::read_to_string(csv).with_context(|| format!("cannot read {}", csv.display()))?;
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap_or_default().split(',').collect();
    let index = columns
        .iter()
        .map(|name| {
            header
                .iter()
                .position(|h| h == name)
                .with_context(|| format!("{} has no column {name}", csv.display()))
        })
        .collect::<anyhow::Result<Vec<usize>>>()?;
    Ok(lines
        .filter(|l| !l.trim().is_empty())
        .map(|line| {
            let fields: Vec<&str> = line.split(',').collect();
            index
                .iter()
                .map(|&i| {
                    fields
                        .get(i)
                        .and_then(|v| v.parse::<f64>().ok())
                        .unwrap_or(f64::NAN)
                })
                .collect()
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_by_name_in_the_asked_order() {
        let dir = tempfile::tempdir().unwrap();
        let csv = dir.path().join("m.csv");
        std::fs::write(&csv, "step,reward,wall\n1,0.5,2.0\n2,x,3.0\n\n3,0.7\n").unwrap();
        let rows = read_columns(&csv, &["wall", "step"]).unwrap();
        assert_eq!(rows.len(), 3);
        assert_eq!(rows[0], vec![2.0, 1.0]);
        assert!(rows[2][0].is_nan(), "a missing field is NaN");
        let r = read_columns(&csv, &["reward"]).unwrap();
        assert!(r[1][0].is_nan(), "a non-number is NaN");
        let e = read_columns(&csv, &["loss"]).unwrap_err().to_string();
        assert!(e.contains("has no column loss"), "{e}");
        let e = read_columns(&dir.path().join("none.csv"), &["step"]).unwrap_err();
        assert!(e.to_string().contains("cannot read"), "{e}");
    }
}
