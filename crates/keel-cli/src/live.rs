//! placeholder
use crate::config::Settings;
use clap::Args;
use std::process::ExitCode;
/// args
#[derive(Debug, Args)]
pub struct RunArgs {}
/// run
pub async fn run(_args: RunArgs, _s: &Settings) -> anyhow::Result<ExitCode> {
    anyhow::bail!("not yet")
}
