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
