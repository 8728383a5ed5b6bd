use std::io::Write;

use super::*;

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("pdpair-pool-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    dir
}

#[test]
fn mapping_path_names_the_file_behind_an_address_and_nothing_else() {
    let dir = scratch("maps");
    let path = dir.join("a pool file");
    let mut file = File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .expect("file");
    file.write_all(&[1u8; 8192]).expect("write");
    let map = memmap2::MmapOptions::new().map_raw(&file).expect("map");
    let inside = map.as_ptr() as u64 + 4096;
    assert_eq!(mapping_path(inside), Some(path.clone()), "a name with a space, too");
    let anon = memmap2::MmapMut::map_anon(4096).expect("anon");
    assert_eq!(mapping_path(anon.as_ptr() as u64), None, "anonymous memory has no file");
    std::fs::remove_file(&path).expect("unlink");
    assert_eq!(
        mapping_path(inside),
        None,
        "a deleted file cannot be opened by an engine"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn clean_dir_removes_only_pool_files() {
    let dir = scratch("clean");
    for name in ["ucx_shm_posix_1234", "pdpair-pool-7-0", "engine-0.kv", "notes"] {
        std::fs::write(dir.join(name), b"x").expect("write");
    }
    assert_eq!(clean_dir(&dir), 2);
    let mut left: Vec<String> = std::fs::read_dir(&dir)
        .expect("dir")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(left, ["engine-0.kv", "notes"]);
    assert_eq!(
        clean_dir(&dir.join("missing")),
        0,
        "a missing directory is nothing to clean"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn peer_owner_reads_the_other_ends_credentials() {
    use std::os::unix::fs::MetadataExt;
    let (a, _b) = UnixStream::pair().expect("pair");
    let me = std::fs::metadata("/proc/self").expect("/proc/self");
    assert_eq!(peer_owner(&a), Some((me.uid(), me.gid())));
}

#[test]
fn the_memory_limit_is_read_where_cgroup_v1_or_v2_keeps_it() {
    let files = |entries: &[(&str, &str)]| {
        let map: std::collections::HashMap<String, String> = entries
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        move |path: &str| map.get(path).cloned()
    };
    // cgroup v2, at the path the process's cgroup names.
    let v2 = files(&[
        ("/sys/fs/cgroup/kubepods/pod1/c1/memory.max", "1073741824\n"),
        ("/sys/fs/cgroup/kubepods/pod1/c1/memory.current", "104857600\n"),
    ]);
    assert_eq!(cgroup_memory("0::/kubepods/pod1/c1\n", &v2), Some((1 << 30, 100 << 20)));
    // In a cgroup namespace of its own the path is `/`, and the limit is at the root.
    let ns = files(&[
        ("/sys/fs/cgroup/memory.max", "536870912\n"),
        ("/sys/fs/cgroup/memory.current", "1\n"),
    ]);
    assert_eq!(cgroup_memory("0::/\n", &ns), Some((512 << 20, 1)));
    // No limit.
    let unlimited = files(&[
        ("/sys/fs/cgroup/memory.max", "max\n"),
        ("/sys/fs/cgroup/memory.current", "1\n"),
    ]);
    assert_eq!(cgroup_memory("0::/\n", &unlimited), None);
    // cgroup v1, the memory hierarchy's line (the unified line beside it has no memory files).
    let v1 = files(&[
        (
            "/sys/fs/cgroup/memory/process_api/x/memory.limit_in_bytes",
            "536870912\n",
        ),
        ("/sys/fs/cgroup/memory/process_api/x/memory.usage_in_bytes", "4096\n"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n"),
    ]);
    let text = "5:devices:/\n4:memory:/process_api/x\n0::/\n";
    assert_eq!(cgroup_memory(text, &v1), Some((512 << 20, 4096)));
    // v1's "no limit" is a number near 2^63.
    let v1_unlimited = files(&[
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n"),
        ("/sys/fs/cgroup/memory/memory.usage_in_bytes", "4096\n"),
    ]);
    assert_eq!(cgroup_memory("4:memory:/\n", &v1_unlimited), None);
}
