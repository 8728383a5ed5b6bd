//! `pdpair-agent checksum` against a slow, obviously-correct reference written here, straight
//! from the definition in ../shared/DESIGN.md (independent of pdpair-api's reference).

use std::process::Command;

fn run(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_pdpair-agent"))
        .arg("checksum")
        .args(args)
        .output()
        .expect("runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The definition, literally (the arguments mirror the CLI's flags one to one): per layer l, head h, token t < n, piece p: x * m * (2j+1).
#[allow(clippy::too_many_arguments)]
fn obviously_correct(
    dump: &[u8],
    layers: u64,
    heads: u64,
    head_dim: u64,
    elem: u64,
    block: u64,
    first: u64,
    n: u64,
) -> Vec<u64> {
    let token_bytes = 2 * head_dim * elem;
    let pieces = token_bytes / 8;
    let block_bytes = (layers * heads * block * token_bytes) as usize;
    let mut out = Vec::new();
    for (b, bytes) in dump.chunks(block_bytes).enumerate() {
        let mut sum: u128 = 0;
        for l in 0..layers {
            for h in 0..heads {
                let m = 2 * (l * 65536 + h) + 1;
                for i in 0..block {
                    let t = first + b as u64 * block + i;
                    if t >= n {
                        continue;
                    }
                    for p in 0..pieces {
                        let at = (((l * heads + h) * block + i) * token_bytes + p * 8) as usize;
                        let x = u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
                        let j = t * pieces + p;
                        sum += u128::from(x) * u128::from(m) * u128::from(2 * j + 1);
                    }
                }
            }
        }
        out.push((sum % (1u128 << 64)) as u64);
    }
    out
}

fn dump(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (x >> 33) as u8
        })
        .collect()
}

#[test]
fn prints_one_checksum_per_block_matching_the_definition() {
    let dir = std::env::temp_dir().join(format!("pdpair-checksum-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    // 2 layers, 4 heads, head_dim 8, bf16, block 16, 3 blocks, tokens 100..140 (last block partial).
    let (layers, heads, hd, elem, block) = (2u64, 4u64, 8u64, 2u64, 16u64);
    let bytes = dump((layers * heads * block * 2 * hd * elem * 3) as usize, 42);
    let file = dir.join("kv.bin");
    std::fs::write(&file, &bytes).expect("write dump");
    let path = file.to_string_lossy();
    let (code, stdout, stderr) = run(&[
        "--layers",
        "2",
        "--kv-heads",
        "4",
        "--head-dim",
        "8",
        "--cache-dtype",
        "bfloat16",
        "--block-size",
        "16",
        "--num-tokens",
        "140",
        "--first-token",
        "100",
        &path,
    ]);
    assert_eq!(code, 0, "{stderr}");
    let got: Vec<u64> = stdout.lines().map(|l| l.parse().expect("decimal u64")).collect();
    assert_eq!(got, obviously_correct(&bytes, layers, heads, hd, elem, block, 100, 140));
    assert_eq!(got.len(), 3);
    // Past num_tokens: the third block holds tokens 132..148, of which 132..140 count.
    assert_ne!(got[2], 0);
    // MLA: a token's one latent vector of 16 elements reads as the definition's K then V of 8
    // each would (the same bytes in the same order), and its sum is theirs.
    let (code, mla, stderr) = run(&[
        "--mla",
        "--layers",
        "2",
        "--kv-heads",
        "4",
        "--head-dim",
        "16",
        "--cache-dtype",
        "bfloat16",
        "--block-size",
        "16",
        "--num-tokens",
        "140",
        "--first-token",
        "100",
        &path,
    ]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(mla, stdout, "a latent of 16 sums as K and V of 8");
    // fp8 with the default first token.
    let (code, stdout, _) = run(&[
        "--layers",
        "2",
        "--kv-heads",
        "4",
        "--head-dim",
        "16",
        "--cache-dtype",
        "fp8_e4m3",
        "--block-size",
        "16",
        "--num-tokens",
        "1000",
        &path,
    ]);
    assert_eq!(code, 0);
    let got: Vec<u64> = stdout.lines().map(|l| l.parse().expect("decimal u64")).collect();
    assert_eq!(got, obviously_correct(&bytes, 2, 4, 16, 1, 16, 0, 1000));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_input_exits_2_with_a_message() {
    let dir = std::env::temp_dir().join(format!("pdpair-checksum-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let file = dir.join("short.bin");
    std::fs::write(&file, [0u8; 100]).expect("write");
    let path = file.to_string_lossy();
    let base = [
        "--layers",
        "1",
        "--kv-heads",
        "1",
        "--head-dim",
        "4",
        "--block-size",
        "4",
        "--num-tokens",
        "4",
    ];
    let (code, _, err) = run(&[&base[..], &["--cache-dtype", "bfloat16", &path]].concat());
    assert_eq!(code, 2);
    assert!(
        err.contains("100 bytes is not a whole number of 64-byte blocks"),
        "{err}"
    );
    let (code, _, err) = run(&[&base[..], &["--cache-dtype", "int4", &path]].concat());
    assert_eq!(code, 2);
    assert!(err.contains("\"int4\""), "{err}");
    let (code, _, err) = run(&[&base[..], &["--cache-dtype", "bfloat16", "/nonexistent/kv.bin"]].concat());
    assert_eq!(code, 2);
    assert!(err.contains("/nonexistent/kv.bin: cannot read"), "{err}");
    let odd = [
        "--layers",
        "1",
        "--kv-heads",
        "1",
        "--head-dim",
        "2",
        "--block-size",
        "4",
        "--num-tokens",
        "4",
        "--cache-dtype",
        "fp8",
    ];
    let (code, _, err) = run(&[&odd[..], &[&path[..]]].concat());
    assert_eq!(code, 2);
    assert!(err.contains("not a multiple of 8"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
