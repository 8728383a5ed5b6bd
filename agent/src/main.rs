//! The pdpair-agent command line. Logic lives in the library.

use clap::Parser;

#[derive(Debug, Parser)]
#[command(
    name = "pdpair-agent",
    version,
    about = "pdpair node agent (skeleton: no subcommands yet)"
)]
struct Cli {}

fn main() {
    let Cli {} = Cli::parse();
    eprintln!("pdpair-agent: nothing to run yet; the node agent is not implemented");
    std::process::exit(2);
}
