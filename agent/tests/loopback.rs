//! `pdpair-agent loopback`: real agent processes, real sockets, real UCX, synthetic engines.

use std::{path::PathBuf, process::Command};

use serde_json::Value;

fn examples(name: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../examples")
        .join(name)
        .to_string_lossy()
        .into_owned()
}

fn run(args: &[&str]) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_pdpair-agent"))
        .arg("loopback")
        .args(args)
        .args(["-o", "json"])
        .output()
        .expect("runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "loopback failed: {stderr}");
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

/// A small pair (2 layers, 2 heads of 64, bf16) with these block sizes and transfer settings.
fn manifest_with(
    dir: &std::path::Path,
    name: &str,
    mode: &str,
    checksum: &str,
    layout: &str,
    p_block: u32,
    d_block: u32,
) -> String {
    let text = format!(
        "apiVersion: pdpair.dev/v1alpha1\nkind: PDPair\nmetadata:\n  name: {name}\nspec:\n  transfer:\n    mode: {mode}\n    checksum: {checksum}\n    handshakeTimeout: 10s\n    leaseDuration: 20s\n  prefill:\n    kv: &kv\n      engine: vllm\n      model: tiny\n      dtype: bfloat16\n      layers: 2\n      kvHeads: 2\n      headDim: 64\n      attentionBackend: FLASH_ATTN\n      layout: {layout}\n      blockSize: {p_block}\n  decode:\n    kv:\n      <<: *kv\n      blockSize: {d_block}\n"
    );
    let path = dir.join(format!("{name}.yaml"));
    std::fs::write(&path, text).expect("write manifest");
    path.to_string_lossy().into_owned()
}

/// A push pair, HND.
fn manifest(dir: &std::path::Path, name: &str, p_block: u32, d_block: u32, checksum: &str) -> String {
    manifest_with(dir, name, "Push", checksum, "HND", p_block, d_block)
}

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("pdpair-loopback-test-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    dir
}

fn count(v: &Value, key: &str) -> u64 {
    v[key].as_u64().unwrap_or_else(|| panic!("{key} missing in {v}"))
}

/// Every one of `n` requests succeeded, its checksums verified and every byte right.
fn assert_all_verified(v: &Value, n: u64, what: &str) {
    assert_eq!(count(v, "succeeded"), n, "{what}: {v}");
    assert_eq!(count(&v["checksum"], "verified"), n, "{what}: {v}");
    assert_eq!(count(v, "byte_errors"), 0, "{what}: {v}");
}

#[test]
fn vllm_cases_are_rejected_at_the_handshake_while_the_compatible_prefill_keeps_being_served() {
    let v = run(&[
        "--pair",
        &examples("vllm-push-64-64.yaml"),
        "--also-prefill",
        &examples("vllm-push-16-64.yaml"),
        "--also-prefill",
        &examples("vllm-push-flashinfer-128-64.yaml"),
        "--requests",
        "9",
        "--prompt-tokens",
        "200",
    ]);
    assert_eq!(v["mode"], "Push");
    assert_eq!(count(&v, "requests"), 9);
    let per = v["per_prefill"].as_array().expect("per_prefill");
    assert_eq!(per[0]["name"], "vllm-push-64-64");
    assert_eq!((count(&per[0], "succeeded"), count(&per[0], "failed")), (3, 0), "{v}");
    assert_eq!(count(&per[1], "rejected"), 3);
    assert_eq!(per[1]["reasons"]["KernelBlockSizeMismatch"], 3);
    assert_eq!(count(&per[2], "rejected"), 3);
    assert_eq!(per[2]["reasons"]["KernelBlocksPerLogicalMismatch"], 3);
    // Rejections come at once, not after the 5 s handshake timeout or a lease (no stall).
    for p in &per[1..] {
        assert!(p["reject_latency_ms"]["max"].as_f64().expect("max") < 5000.0, "{p}");
    }
    assert_eq!(count(&v, "byte_errors"), 0);
    assert!(count(&v, "bytes") > 0);
}

#[test]
fn a_foreign_prefill_is_rejected_as_unauthenticated_and_decode_keeps_serving() {
    let dir = tmp("foreign");
    let pair = manifest(&dir, "tiny", 16, 16, "FailClosed");
    let v = run(&[
        "--pair",
        &pair,
        "--foreign-prefill",
        &pair,
        "--requests",
        "6",
        "--prompt-tokens",
        "100",
    ]);
    let per = v["per_prefill"].as_array().expect("per_prefill");
    assert_eq!(count(&per[0], "succeeded"), 3);
    assert_eq!(count(&per[1], "rejected"), 3);
    assert_eq!(per[1]["reasons"]["Unauthenticated"], 3);
    assert_eq!(count(&v["checksum"], "verified"), 3);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_corrupted_byte_is_caught_for_every_request_under_fail_closed_and_logged_under_fail_open() {
    let dir = tmp("corrupt");
    let closed = manifest(&dir, "closed", 16, 16, "FailClosed");
    let v = run(&[
        "--pair",
        &closed,
        "--corrupt-one-byte",
        "--requests",
        "4",
        "--prompt-tokens",
        "100",
        "--transport",
        "shm",
    ]);
    assert_eq!((count(&v, "succeeded"), count(&v, "failed")), (0, 4), "{v}");
    assert_eq!(v["per_prefill"][0]["reasons"]["ChecksumMismatch"], 4, "{v}");
    assert_eq!(count(&v["checksum"], "mismatched"), 4, "{v}");
    let open = manifest(&dir, "open", 16, 16, "FailOpen");
    let v = run(&[
        "--pair",
        &open,
        "--corrupt-one-byte",
        "--requests",
        "4",
        "--prompt-tokens",
        "100",
    ]);
    assert_eq!(count(&v, "succeeded"), 4, "{v}");
    assert_eq!(count(&v["checksum"], "mismatched"), 4, "{v}");
    assert_eq!(count(&v, "byte_errors"), 4, "decode's own byte check agrees: {v}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_killed_prefill_fails_its_requests_in_time_while_decode_keeps_serving_the_other() {
    let dir = tmp("kill");
    let pair = manifest(&dir, "tiny", 16, 16, "FailClosed");
    let v = run(&[
        "--pair",
        &pair,
        "--also-prefill",
        &pair,
        "--kill-prefill-after",
        "2",
        "--requests",
        "10",
        "--prompt-tokens",
        "100",
    ]);
    let per = v["per_prefill"].as_array().expect("per_prefill");
    // The second prefill is served throughout.
    assert_eq!((count(&per[1], "succeeded"), count(&per[1], "failed")), (5, 0), "{v}");
    // The first serves at most its first two requests, then every later one fails with a reason.
    assert!(count(&per[0], "succeeded") <= 2, "{v}");
    assert!(count(&per[0], "failed") >= 3, "{v}");
    let reasons = per[0]["reasons"].as_object().expect("reasons");
    assert!(
        reasons.keys().all(|r| r == "PeerLost" || r == "HandshakeFailed"),
        "{reasons:?}"
    );
    assert!(!reasons.contains_key("LoopbackTimeout"), "no request waited forever");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn shared_memory_transport_moves_and_verifies() {
    // Pools the agents allocate (the default) and pools the engines bring.
    for memory in ["agent", "engine"] {
        let dir = tmp(&format!("shm-{memory}"));
        let pair = manifest(&dir, "tiny", 32, 32, "FailClosed");
        let v = run(&[
            "--pair",
            &pair,
            "--requests",
            "3",
            "--prompt-tokens",
            "500",
            "--transport",
            "shm",
            "--engine-memory",
            memory,
        ]);
        assert_eq!(v["transport"], "shm");
        assert_all_verified(&v, 3, memory);
        assert_eq!(
            v["paths"],
            serde_json::json!({"SharedMemory/UcxHost": 3}),
            "{memory}: the path reported"
        );
        // 500 tokens -> 16 blocks of 32 -> 512 tokens x 2 layers x 2 heads x 64 x 2 bytes x K,V.
        assert_eq!(count(&v, "bytes"), 3 * 512 * 2 * 2 * 64 * 2 * 2, "{memory}");
        let _ = std::fs::remove_dir_all(dir);
    }
}

#[test]
fn scattered_decode_blocks_pair_by_position_one_write_per_block() {
    let dir = tmp("scatter");
    let pair = manifest(&dir, "tiny", 16, 16, "FailClosed");
    let v = run(&[
        "--pair",
        &pair,
        "--requests",
        "2",
        "--prompt-tokens",
        "200",
        "--scatter-blocks",
    ]);
    assert_all_verified(&v, 2, "scattered");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn unequal_tensor_parallelism_moves_the_decode_ranks_heads_verified() {
    // The realistic example: prefill TP 2, decode TP 4 (8 KV heads, HND, FailClosed). The decode
    // rank holds 2 of prefill rank 0's 4 heads; prefill writes just those (push), or decode reads
    // just those (the same pair in pull mode).
    let dir = tmp("tp");
    let pull = dir.join("compatible-pull.yaml");
    let text = std::fs::read_to_string(examples("compatible-push.yaml")).expect("example");
    std::fs::write(&pull, text.replace("mode: Push", "mode: Pull")).expect("write");
    for (mode, pair) in [
        ("Push", examples("compatible-push.yaml")),
        ("Pull", pull.to_string_lossy().into_owned()),
    ] {
        let v = run(&["--pair", &pair, "--requests", "3", "--prompt-tokens", "128"]);
        assert_eq!(v["mode"], mode);
        assert_all_verified(&v, 3, mode);
        // 128 tokens x 32 layers x 2 heads x 128 x 2 bytes x K,V.
        assert_eq!(count(&v, "bytes"), 3 * 128 * 32 * 2 * 128 * 2 * 2, "{mode}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// A pull pair with FailClosed checksums.
fn pull_manifest(dir: &std::path::Path, name: &str, p_block: u32, d_block: u32, layout: &str) -> String {
    manifest_with(dir, name, "Pull", "FailClosed", layout, p_block, d_block)
}

#[test]
fn pull_reads_smaller_prefill_blocks_into_larger_decode_blocks_verified() {
    let dir = tmp("pull");
    for layout in ["HND", "NHD"] {
        // Prefill blocks of 16, decode blocks of 32: each decode block gathers two prefill blocks;
        // checksums compare in chunks of 32 tokens. 100 tokens: the last blocks are partial.
        let pair = pull_manifest(&dir, &format!("pull-{layout}"), 16, 32, layout);
        for transport in ["shm", "tcp"] {
            let v = run(&[
                "--pair",
                &pair,
                "--requests",
                "3",
                "--prompt-tokens",
                "100",
                "--transport",
                transport,
            ]);
            assert_eq!(v["mode"], "Pull");
            assert_all_verified(&v, 3, &format!("{layout} {transport}"));
            // Pull: decode's agent moved the bytes and reports the path.
            let path = if transport == "tcp" {
                "Tcp/TcpStream"
            } else {
                "SharedMemory/UcxHost"
            };
            assert_eq!(v["paths"], serde_json::json!({ path: 3 }), "{layout} {transport}");
        }
    }
    // The vLLM pull case that cannot work, decode blocks smaller than prefill's, is refused at
    // the handshake with the rule's reason.
    let v = run(&[
        "--pair",
        &examples("vllm-pull-32-16.yaml"),
        "--requests",
        "2",
        "--prompt-tokens",
        "64",
    ]);
    assert_eq!(count(&v["per_prefill"][0], "rejected"), 2, "{v}");
    assert_eq!(v["per_prefill"][0]["reasons"]["BlockSizeNotDivisible"], 2, "{v}");
    let _ = std::fs::remove_dir_all(dir);
}

/// Every tensor-parallel rank of both pools, each its own engine, a pool's ranks on its one
/// agent, over shm: prefill TP 2 -> decode TP 4 (two decode ranks per prefill rank) and, swapped,
/// TP 4 -> 2 (each decode rank gathers from two prefill ranks), in push and pull; `requests` of
/// 128 tokens each, with `extra` arguments. Every request verified, every byte right, and all 8
/// heads of every token moved.
fn every_rank_both_ways(dir: &std::path::Path, requests: u64, extra: &[&str]) {
    let text = std::fs::read_to_string(examples("compatible-push.yaml")).expect("example");
    let swapped = text
        .replace("parallelism: { tensor: 2 }", "parallelism: { tensor: X }")
        .replace("parallelism: { tensor: 4 }", "parallelism: { tensor: 2 }")
        .replace("parallelism: { tensor: X }", "parallelism: { tensor: 4 }");
    for (name, manifest) in [("2-to-4", text.clone()), ("4-to-2", swapped)] {
        for mode in ["Push", "Pull"] {
            let path = dir.join(format!("{name}-{mode}.yaml"));
            std::fs::write(&path, manifest.replace("mode: Push", &format!("mode: {mode}"))).expect("write");
            let path = path.to_string_lossy();
            let requests_arg = requests.to_string();
            let mut args = vec![
                "--pair",
                &path,
                "--requests",
                &requests_arg,
                "--prompt-tokens",
                "128",
                "--transport",
                "shm",
                "--all-ranks",
            ];
            args.extend_from_slice(extra);
            let v = run(&args);
            assert_all_verified(&v, requests, &format!("{name} {mode}"));
            assert_eq!(v["byte_errors"], 0, "{v}");
            // All 8 heads of every token: 128 tokens x 32 layers x 8 heads x 128 x 2 bytes x K,V.
            assert_eq!(
                count(&v, "bytes"),
                requests * 128 * 32 * 8 * 128 * 2 * 2,
                "{name} {mode}"
            );
        }
    }
}

#[test]
fn all_ranks_of_both_pools_move_every_head_verified() {
    let dir = tmp("all-ranks");
    every_rank_both_ways(&dir, 2, &[]);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn decode_pools_with_k_and_v_side_by_side_take_head_ranges_and_larger_blocks_verified() {
    // vLLM 0.33's layout on decode (one region, each head's token's K and V side by side)
    // against prefill's K and V arrays, so each head's token moves on its own: every rank of TP
    // 2 -> 4 and 4 -> 2 (head ranges of blocks) in push and pull, blocks outermost, and pull of
    // 16-token prefill blocks into 32-token decode blocks, HND and NHD, layers outermost. Every
    // byte checked.
    let dir = tmp("side-by-side");
    every_rank_both_ways(&dir, 1, &["--side-by-side", "decode", "--blocks-outermost"]);
    for layout in ["HND", "NHD"] {
        let pair = pull_manifest(&dir, &format!("larger-{layout}"), 16, 32, layout);
        let v = run(&[
            "--pair",
            &pair,
            "--requests",
            "2",
            "--prompt-tokens",
            "100",
            "--side-by-side",
            "decode",
        ]);
        assert_all_verified(&v, 2, layout);
        assert_eq!(v["byte_errors"], 0, "{v}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn pools_of_one_region_per_layer_move_the_same_bytes_verified() {
    // vLLM's per-layer KV tensors as the engines' pools: every layer its own region on both
    // sides, push and pull; the bytes moved and verified equal the one-region run's.
    let dir = tmp("region-per-layer");
    for (name, pair) in [
        ("push", manifest(&dir, "layers-push", 32, 32, "FailClosed")),
        ("pull", pull_manifest(&dir, "layers-pull", 16, 32, "HND")),
    ] {
        let args = |extra: &[&str]| {
            let mut a = vec!["--pair", &pair, "--requests", "2", "--prompt-tokens", "100"];
            a.extend_from_slice(extra);
            run(&a)
        };
        let (one, per_layer) = (args(&[]), args(&["--region-per-layer"]));
        assert_all_verified(&per_layer, 2, name);
        assert_eq!(per_layer["byte_errors"], 0, "{per_layer}");
        assert_eq!(count(&one, "bytes"), count(&per_layer, "bytes"), "{name}");
        assert_eq!(
            (one["decode_regions"].as_u64(), per_layer["decode_regions"].as_u64()),
            (Some(1), Some(2)),
            "{name}"
        );
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_prefix_hit_on_decode_moves_only_the_tail_every_byte_checked() {
    let dir = tmp("prefix-hit");
    // Push with equal blocks, and pull with decode blocks of 32 over prefill's 16: decode holds
    // the first 64 tokens of 200 and asks only from token 64.
    for (name, pair) in [
        ("push", manifest(&dir, "hit-push", 32, 32, "FailClosed")),
        ("pull", pull_manifest(&dir, "hit-pull", 16, 32, "HND")),
    ] {
        let args = |hit: &str| {
            run(&[
                "--pair",
                &pair,
                "--requests",
                "2",
                "--prompt-tokens",
                "200",
                "--decode-prefix-hit",
                hit,
            ])
        };
        let (whole, tail) = (args("0"), args("64"));
        assert_all_verified(&tail, 2, name);
        assert_eq!(tail["byte_errors"], 0, "{tail}");
        assert_eq!(tail["decode_prefix_hit"], 64, "{tail}");
        // 2 layers x K/V x 2 heads x 64 dim x 2 bytes = 1 KiB per token of whole blocks.
        let (w, t) = (count(&whole, "bytes"), count(&tail, "bytes"));
        assert_eq!(
            w - t,
            2 * 64 * 1024,
            "{name}: the held 64 tokens did not move ({w} vs {t})"
        );
    }
    // Not whole decode blocks: refused, naming both.
    let child = Command::new(env!("CARGO_BIN_EXE_pdpair-agent"))
        .args(["loopback", "--pair", &examples("vllm-push-64-64.yaml")])
        .args(["--prompt-tokens", "200", "--decode-prefix-hit", "100"])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("runs");
    let pid = child.id();
    let out = child.wait_with_output().expect("ends");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--decode-prefix-hit 100") && err.contains("64"), "{err}");
    // ... and leaves no agent process behind (its agents work in pdpair-loopback-<pid>).
    let mark = format!("pdpair-loopback-{pid}/");
    let left: Vec<String> = std::fs::read_dir("/proc")
        .expect("/proc")
        .flatten()
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
        .filter(|c| c.contains(&mark))
        .collect();
    assert!(left.is_empty(), "agents outlived the refused scenario: {left:?}");
    let _ = std::fs::remove_dir_all(dir);
}
