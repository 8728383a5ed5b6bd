//! `pdpair-operator validate`, driven as CI pipelines drive it: the real binary, files on disk,
//! exit codes and output.

use std::{io::Write, path::PathBuf, process::Command};

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

fn validate(args: &[&str], stdin: Option<&str>) -> Run {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_pdpair-operator"));
    cmd.arg("validate").args(args);
    cmd.stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = cmd.spawn().expect("run pdpair-operator");
    let mut input = child.stdin.take().expect("stdin");
    input.write_all(stdin.unwrap_or("").as_bytes()).expect("write stdin");
    drop(input);
    let out = child.wait_with_output().expect("wait for pdpair-operator");
    Run {
        code: out.status.code().expect("exit code"),
        stdout: String::from_utf8(out.stdout).expect("utf-8 stdout"),
        stderr: String::from_utf8(out.stderr).expect("utf-8 stderr"),
    }
}

/// A temporary directory removed on drop.
struct Dir(PathBuf);

impl Dir {
    fn new(name: &str) -> Dir {
        let dir = std::env::temp_dir().join(format!("pdpair-validate-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create temp dir");
        Dir(dir)
    }

    fn file(&self, name: &str, text: &str) -> String {
        let path = self.0.join(name);
        std::fs::write(&path, text).expect("write temp file");
        path.to_string_lossy().into_owned()
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn examples(name: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../examples")
        .join(name)
        .to_string_lossy()
        .into_owned()
}

/// A PDPair document with these block sizes (kernel = logical).
fn pair(name: &str, mode: &str, prefill_block: i32, decode_block: i32) -> String {
    format!(
        "apiVersion: pdpair.dev/v1alpha1\nkind: PDPair\nmetadata:\n  name: {name}\n  namespace: team-a\nspec:\n  transfer:\n    mode: {mode}\n  prefill:\n    kv: &kv\n      engine: vllm\n      model: m\n      dtype: bfloat16\n      layers: 2\n      kvHeads: 2\n      headDim: 64\n      attentionBackend: FLASH_ATTN\n      layout: HND\n      blockSize: {prefill_block}\n  decode:\n    kv:\n      <<: *kv\n      blockSize: {decode_block}\n"
    )
}

fn json(run: &Run) -> serde_json::Value {
    serde_json::from_str(&run.stdout).unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {}", run.stdout))
}

#[test]
fn admitted_pair_exits_0() {
    let dir = Dir::new("ok");
    let f = dir.file("ok.yaml", &pair("ok", "Push", 64, 64));
    let run = validate(&[&f], None);
    assert_eq!(run.code, 0, "{}{}", run.stdout, run.stderr);
    assert_eq!(run.stdout, format!("{f}: PDPair team-a/ok: admitted\n"));
}

#[test]
fn multi_document_file_with_a_rejection_exits_1_and_reports_each_in_order() {
    let dir = Dir::new("multi");
    let text = format!(
        "{}---\napiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: cm\n---\n{}---\n",
        pair("bad", "Push", 16, 64),
        pair("good", "Pull", 16, 32)
    );
    let f = dir.file("multi.yaml", &text);
    let run = validate(&[&f], None);
    assert_eq!(run.code, 1, "{}{}", run.stdout, run.stderr);
    let lines: Vec<&str> = run.stdout.lines().collect();
    assert_eq!(lines[0], format!("{f}: PDPair team-a/bad: rejected"));
    assert!(
        lines[1].starts_with("    KernelBlockSizeMismatch spec.decode.kv.kernelBlockSize: "),
        "{}",
        lines[1]
    );
    assert!(lines[1].contains("16") && lines[1].contains("64"));
    assert_eq!(lines[2], format!("{f}: PDPair team-a/good: admitted"));
    assert_eq!(lines.len(), 3);
    // The ConfigMap is skipped, but not silently.
    assert!(run.stderr.contains("document 2: v1 ConfigMap cm"), "{}", run.stderr);
}

#[test]
fn json_output_is_one_array_in_input_order() {
    let dir = Dir::new("json");
    let a = dir.file("a.yaml", &pair("a", "Pull", 32, 16));
    let b = dir.file("b.yaml", &pair("b", "Push", 64, 64));
    let run = validate(&["-o", "json", &a, &b], None);
    assert_eq!(run.code, 1);
    let v = json(&run);
    let items = v.as_array().expect("an array");
    assert_eq!(items.len(), 2);
    assert_eq!(items[0]["file"], a.as_str());
    assert_eq!(items[0]["name"], "a");
    assert_eq!(items[0]["namespace"], "team-a");
    assert_eq!(items[0]["allowed"], false);
    assert_eq!(items[0]["violations"][0]["reason"], "BlockSizeNotDivisible");
    assert_eq!(items[0]["violations"][0]["field"], "spec.decode.kv.kernelBlockSize");
    assert!(
        items[0]["violations"][0]["message"]
            .as_str()
            .is_some_and(|m| m.contains("16") && m.contains("32"))
    );
    assert_eq!(items[1]["name"], "b");
    assert_eq!(items[1]["allowed"], true);
    assert_eq!(items[1]["violations"], serde_json::json!([]));
}

#[test]
fn malformed_yaml_exits_2_naming_file_and_document() {
    let dir = Dir::new("yaml");
    let f = dir.file(
        "broken.yaml",
        &format!("{}---\nspec: [unclosed\n", pair("first", "Push", 64, 64)),
    );
    let run = validate(&["-o", "json", &f], None);
    assert_eq!(run.code, 2, "{}", run.stderr);
    assert!(
        run.stderr.contains(&format!("{f}: document 2: invalid YAML")),
        "{}",
        run.stderr
    );
    // The valid document before it is still reported.
    assert_eq!(json(&run)[0]["name"], "first");
}

#[test]
fn wrong_type_exits_2_naming_the_field() {
    let dir = Dir::new("type");
    let f = dir.file("t.yaml", &pair("t", "Push", 64, 64).replace("layers: 2", "layers: two"));
    let run = validate(&[&f], None);
    assert_eq!(run.code, 2);
    assert!(
        run.stderr.contains("document 1: spec.prefill.kv.layers: invalid type"),
        "{}",
        run.stderr
    );
}

#[test]
fn bad_enum_and_duration_exit_2_naming_the_value() {
    let dir = Dir::new("enum");
    let f = dir.file("e.yaml", &pair("e", "Sideways", 64, 64));
    let run = validate(&[&f], None);
    assert_eq!(run.code, 2);
    assert!(
        run.stderr.contains("spec.transfer.mode") && run.stderr.contains("Sideways"),
        "{}",
        run.stderr
    );
    let g = dir.file(
        "d.yaml",
        &pair("d", "Push", 64, 64).replace("mode: Push", "mode: Push\n    leaseDuration: soon"),
    );
    let run = validate(&[&g], None);
    assert_eq!(run.code, 2);
    assert!(
        run.stderr.contains("spec.transfer.leaseDuration") && run.stderr.contains("\"soon\""),
        "{}",
        run.stderr
    );
}

#[test]
fn unknown_field_exits_2_naming_it() {
    let dir = Dir::new("unknown");
    let f = dir.file(
        "u.yaml",
        &pair("u", "Push", 64, 64).replace(
            "blockSize: 64\n  decode",
            "blockSize: 64\n      kernelBlocksize: 16\n  decode",
        ),
    );
    let run = validate(&[&f], None);
    assert_eq!(run.code, 2);
    // The merge key copies it into decode too.
    assert!(
        run.stderr
            .contains("unknown fields spec.prefill.kv.kernelBlocksize, spec.decode.kv.kernelBlocksize"),
        "{}",
        run.stderr
    );
    // Inside a pod template as well.
    let g = dir.file(
        "t.yaml",
        &pair("t", "Push", 64, 64).replace(
            "  decode:\n",
            "    template:\n      spec:\n        containerz: []\n  decode:\n",
        ),
    );
    let run = validate(&[&g], None);
    assert_eq!(run.code, 2, "{}", run.stderr);
    assert!(
        run.stderr
            .contains("unknown field spec.prefill.template.spec.containerz"),
        "{}",
        run.stderr
    );
}

#[test]
fn missing_file_exits_2() {
    let run = validate(&["/nonexistent/pdpair.yaml"], None);
    assert_eq!(run.code, 2);
    assert!(
        run.stderr.contains("/nonexistent/pdpair.yaml: cannot read"),
        "{}",
        run.stderr
    );
}

#[test]
fn other_pdpair_version_and_objects_without_kind_exit_2() {
    let dir = Dir::new("version");
    let f = dir.file("v.yaml", &pair("v", "Push", 64, 64).replace("v1alpha1", "v1"));
    let run = validate(&[&f], None);
    assert_eq!(run.code, 2);
    assert!(run.stderr.contains("\"pdpair.dev/v1\" is not served"), "{}", run.stderr);
    let g = dir.file("k.yaml", "metadata:\n  name: x\n");
    let run = validate(&[&g], None);
    assert_eq!(run.code, 2);
    assert!(
        run.stderr.contains("document 1: not a Kubernetes object"),
        "{}",
        run.stderr
    );
    let h = dir.file("n.yaml", &pair("n", "Push", 64, 64).replace("  name: n\n", ""));
    let run = validate(&[&h], None);
    assert_eq!(run.code, 2);
    assert!(run.stderr.contains("metadata.name is required"), "{}", run.stderr);
}

#[test]
fn reads_standard_input() {
    let run = validate(&["-"], Some(&pair("piped", "Push", 16, 64)));
    assert_eq!(run.code, 1);
    assert!(
        run.stdout.starts_with("-: PDPair team-a/piped: rejected\n"),
        "{}",
        run.stdout
    );
}

#[test]
fn empty_input_says_so() {
    let run = validate(&["-"], Some("---\n"));
    assert_eq!(run.code, 0);
    assert!(run.stderr.contains("no PDPair found"), "{}", run.stderr);
}

#[test]
fn examples_have_the_documented_verdicts() {
    let cases = [
        ("compatible-push.yaml", None),
        ("vllm-push-16-64.yaml", Some("KernelBlockSizeMismatch")),
        (
            "vllm-push-flashinfer-128-64.yaml",
            Some("KernelBlocksPerLogicalMismatch"),
        ),
        ("vllm-push-64-64.yaml", None),
        ("vllm-pull-16-32.yaml", None),
        ("vllm-pull-32-16.yaml", Some("BlockSizeNotDivisible")),
    ];
    for (file, reason) in cases {
        let run = validate(&["-o", "json", &examples(file)], None);
        let v = json(&run);
        assert_eq!(run.code, if reason.is_some() { 1 } else { 0 }, "{file}: {}", run.stderr);
        let reasons: Vec<&str> = v[0]["violations"]
            .as_array()
            .expect("violations")
            .iter()
            .filter_map(|x| x["reason"].as_str())
            .collect();
        assert_eq!(reasons, reason.into_iter().collect::<Vec<_>>(), "{file}");
    }
}

#[test]
fn a_name_the_webhook_refuses_as_too_long_exits_2_naming_it() {
    // The webhook refuses a name over 63 characters (a label value of the pair's pods); the
    // linter said "admitted".
    let dir = Dir::new("long-name");
    let name = "n".repeat(64);
    let f = dir.file("long.yaml", &pair(&name, "Push", 64, 64));
    let run = validate(&[&f], None);
    assert_eq!(run.code, 2, "{}{}", run.stdout, run.stderr);
    assert!(
        run.stderr
            .contains("metadata.name makes a name of 64 characters; a PDPair's name is at most 63"),
        "{}",
        run.stderr
    );
    let f = dir.file("ok.yaml", &pair(&"n".repeat(63), "Push", 64, 64));
    assert_eq!(validate(&[&f], None).code, 0);
}

#[test]
fn a_template_that_is_not_a_pod_template_exits_2_naming_where() {
    let dir = Dir::new("template");
    let text = format!(
        "{}    template:\n      spec:\n        containers:\n          - name: vllm\n            env: [{{name: PORT, value: 8000}}]\n",
        pair("t", "Push", 64, 64)
    );
    let f = dir.file("t.yaml", &text);
    let run = validate(&[&f], None);
    assert_eq!(run.code, 2, "{}{}", run.stdout, run.stderr);
    assert!(
        run.stderr
            .contains("spec.decode.template is not a pod template: spec.containers[0].env[0].value: invalid type"),
        "{}",
        run.stderr
    );
}
