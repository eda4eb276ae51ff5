//! placeholder
use crate::config::Settings;
use clap::Args;
use std::process::ExitCode;
/// args
#[derive(Debug, Args)]
pub struct ThreadsArgs {}
/// run
pub async fn run(_args: ThreadsArgs, _s: &Settings) -> anyhow::Result<ExitCode> {
    anyhow::bail!("not yet")
}
