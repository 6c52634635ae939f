//! `asyncrl bench weights` (being written: see issue #17).

use clap::Args;

#[derive(Debug, Args)]
pub(crate) struct WeightsArgs {}

pub(crate) fn run(_rt: &tokio::runtime::Runtime, _args: WeightsArgs) -> anyhow::Result<String> {
    anyhow::bail!("asyncrl bench weights is not built yet")
}
