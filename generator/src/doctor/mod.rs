//! `deepep-nix doctor` (being written; see issue "doctor").
use clap::Args;

#[derive(Debug, Clone, Args)]
pub struct DoctorArgs {
    /// Print JSON instead of the table.
    #[arg(long)]
    pub json: bool,
}

pub fn run(_args: &DoctorArgs) -> anyhow::Result<i32> {
    anyhow::bail!("doctor is not built yet")
}
