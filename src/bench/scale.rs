//! `asyncrl bench scale` (being written: see issue #17).

use clap::Args;

#[derive(Debug, Args)]
pub(crate) struct ScaleArgs {}

pub(crate) fn run(_rt: &tokio::runtime::Runtime, _args: ScaleArgs) -> anyhow::Result<String> {
    anyhow::bail!("asyncrl bench scale is not built yet")
}
