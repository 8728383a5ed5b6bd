//! Command implementations behind `main.rs`.

use std::{io::Write, path::Path};

use pdpair_api::{CacheDtype, checksum::Shape};

/// Arguments of `pdpair-agent checksum`.
#[derive(Clone, Debug, clap::Args)]
pub struct ChecksumArgs {
    /// Layers in the dump.
    #[arg(long)]
    pub layers: u32,
    /// KV heads in the dump (the logical, unsharded count).
    #[arg(long = "kv-heads")]
    pub kv_heads: u32,
    /// Elements per head.
    #[arg(long = "head-dim")]
    pub head_dim: u32,
    /// Element type: bfloat16, float16, float32, fp8, fp8_e4m3 or fp8_e5m2.
    #[arg(long = "cache-dtype")]
    pub cache_dtype: String,
    /// Tokens per block.
    #[arg(long = "block-size")]
    pub block_size: u32,
    /// The request's token count; tokens at or past it count as zero.
    #[arg(long = "num-tokens")]
    pub num_tokens: u64,
    /// Absolute position of the dump's first token.
    #[arg(long = "first-token", default_value_t = 0)]
    pub first_token: u64,
    /// The dump: blocks in order; inside a block, for each layer, for each head, for each token,
    /// the K bytes of that head then its V bytes (little-endian elements).
    pub file: std::path::PathBuf,
}

/// A usage problem, reported with exit code 2.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

/// Parses a cache dtype name into element bytes.
pub fn element_bytes(name: &str) -> Result<u32, UsageError> {
    let dtype: CacheDtype = serde_json::from_value(serde_json::Value::String(name.to_owned())).map_err(|_| {
        UsageError(format!(
            "--cache-dtype {name:?} is not one of bfloat16, float16, float32, fp8, fp8_e4m3, fp8_e5m2"
        ))
    })?;
    dtype
        .element_bytes()
        .ok_or_else(|| UsageError("--cache-dtype auto cannot be used here: pass the resolved dtype".into()))
}

/// Runs `checksum`, writing one decimal u64 per block to `out`.
pub fn checksum(args: &ChecksumArgs, out: &mut dyn Write) -> Result<(), UsageError> {
    let shape = Shape {
        layers: args.layers,
        heads: args.kv_heads,
        head_dim: args.head_dim,
        element_bytes: element_bytes(&args.cache_dtype)?,
    };
    for (flag, value) in [
        ("--layers", args.layers),
        ("--kv-heads", args.kv_heads),
        ("--head-dim", args.head_dim),
        ("--block-size", args.block_size),
    ] {
        if value == 0 {
            return Err(UsageError(format!("{flag} must be at least 1")));
        }
    }
    if shape.pieces_per_token().is_none() {
        return Err(UsageError(format!(
            "a token's K and V take 2 x head-dim {} x {} bytes = {} bytes, not a multiple of 8: the checksum reads 8-byte pieces",
            args.head_dim,
            shape.element_bytes,
            shape.token_bytes()
        )));
    }
    let dump = read(&args.file)?;
    let block_bytes = shape.canonical_block_bytes(args.block_size);
    let sums = crate::checksum::canonical_dump(&shape, args.block_size, args.first_token, args.num_tokens, &dump).ok_or_else(|| {
        UsageError(format!(
            "{}: {} bytes is not a whole number of {block_bytes}-byte blocks (layers x kv-heads x block-size x 2 x head-dim x element bytes)",
            args.file.display(),
            dump.len()
        ))
    })?;
    for s in sums {
        writeln!(out, "{s}").map_err(|e| UsageError(format!("writing output: {e}")))?;
    }
    Ok(())
}

fn read(path: &Path) -> Result<Vec<u8>, UsageError> {
    std::fs::read(path).map_err(|e| UsageError(format!("{}: cannot read: {e}", path.display())))
}
