//! The on-disk cache of XLA executables, shared by compiled mode's programs and eager mode's
//! per-op executables: each is stored under a hash of its module text and of the plugin,
//! compiler flags and device, so a later process loads it instead of compiling. Each entry
//! carries its key, length and checksum, checked before the plugin sees the bytes.

use std::path::{Path, PathBuf};

use crate::pjrt::{self, LoadedExecutable};

/// Environment variable: a directory for the on-disk cache of compiled executables (compiled
/// mode's programs and eager mode's ops).
pub const COMPILE_CACHE_ENV: &str = "OXIDIFF_COMPILE_CACHE";

/// Environment variable: when set (to anything but `0`), every compile is printed to stderr
/// with its reason (and, in compiled mode, its timings).
pub const LOG_COMPILES_ENV: &str = "OXIDIFF_LOG_COMPILES";

/// The cache directory [`COMPILE_CACHE_ENV`] names, if any.
pub fn dir_from_env() -> Option<PathBuf> {
    std::env::var_os(COMPILE_CACHE_ENV)
        .filter(|dir| !dir.is_empty())
        .map(PathBuf::from)
}

pub(crate) fn log_compiles() -> bool {
    std::env::var(LOG_COMPILES_ENV).is_ok_and(|v| v != "0")
}

/// FNV-1a, 64 bits: a hash that is the same in every process and build.
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    for part in parts {
        for &byte in part.iter().chain(&(part.len() as u64).to_le_bytes()) {
            hash ^= u64::from(byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
    }
    hash
}

/// The on-disk cache key of `module` compiled by `client` for `device_id`:
/// the module's hash and that of the plugin version and device.
pub(crate) fn disk_key(module: &str, client: &pjrt::Client, device_id: i32) -> String {
    format!(
        "{:016x}-{}",
        fnv1a(&[module.as_bytes()]),
        target_key(client, device_id)
    )
}

/// The part of [`disk_key`] that names the target: the plugin, its version and the device.
fn target_key(client: &pjrt::Client, device_id: i32) -> String {
    // The compiler's options are part of the target: an executable built under other
    // `XLA_FLAGS` (oxidiff's XLA CPU defaults included, set before the plugin loaded) or
    // `LIBTPU_INIT_ARGS` is not the one this process would build.
    let flags = |name: &str| std::env::var(name).unwrap_or_default();
    let target = fnv1a(&[
        client.platform_name().as_bytes(),
        client.platform_version().as_bytes(),
        &device_id.to_le_bytes(),
        env!("CARGO_PKG_VERSION").as_bytes(),
        flags("XLA_FLAGS").as_bytes(),
        flags("LIBTPU_INIT_ARGS").as_bytes(),
    ]);
    format!("{target:016x}")
}

/// Programs remembered per warm-start tag, most recent last.
const WARM_KEYS: usize = 8;

/// Where the programs last used under warm-start `tag` are listed: `warm/<hash>.txt` in `dir`,
/// one `key outputs` line each.
fn warm_list_path(dir: &Path, tag: &str) -> PathBuf {
    dir.join("warm")
        .join(format!("{:016x}.txt", fnv1a(&[tag.as_bytes()])))
}

/// The programs listed for `tag` (by [`remember_warm`]) that were built for this client and
/// device, with their output counts, most recent last. A missing or damaged list is empty:
/// warm starts only save time.
pub(crate) fn warm_keys(
    dir: &Path,
    tag: &str,
    client: &pjrt::Client,
    device_id: i32,
) -> Vec<(String, usize)> {
    let target = format!("-{}", target_key(client, device_id));
    let Ok(text) = std::fs::read_to_string(warm_list_path(dir, tag)) else {
        return Vec::new();
    };
    parse_warm_list(&text)
        .into_iter()
        .filter(|(key, _)| key.ends_with(&target))
        .collect()
}

/// The `key outputs` lines of a warm list; others are skipped.
fn parse_warm_list(text: &str) -> Vec<(String, usize)> {
    text.lines()
        .filter_map(|line| {
            let (key, outputs) = line.split_once(' ')?;
            let valid = key.len() == 33 && key.bytes().all(|b| b == b'-' || b.is_ascii_hexdigit());
            valid.then_some((key.to_string(), outputs.trim().parse().ok()?))
        })
        .collect()
}

/// Lists `key` (a program with `outputs` results) as the most recent under `tag`, keeping the
/// last [`WARM_KEYS`]. Written through a temporary file; a failure only costs the warm start.
pub(crate) fn remember_warm(
    dir: &Path,
    tag: &str,
    key: &str,
    outputs: usize,
) -> Result<(), String> {
    let path = warm_list_path(dir, tag);
    let mut keys = std::fs::read_to_string(&path)
        .map(|text| parse_warm_list(&text))
        .unwrap_or_default();
    if keys.last().is_some_and(|(last, _)| last == key) {
        return Ok(());
    }
    keys.retain(|(k, _)| k != key);
    keys.push((key.to_string(), outputs));
    let skip = keys.len().saturating_sub(WARM_KEYS);
    let text: String = keys[skip..]
        .iter()
        .map(|(k, n)| format!("{k} {n}\n"))
        .collect();
    write_whole(&path, text.as_bytes())
}

/// The first bytes of an on-disk cache entry; the number is the format's
/// version.
const CACHE_MAGIC: &[u8; 16] = b"oxidiff-pjrt-v1\n";

/// An on-disk cache entry: [`CACHE_MAGIC`], the key (u32 length, bytes),
/// the payload's length (u64) and FNV-1a hash (u64), then the plugin's
/// serialized executable. The plugin never sees bytes whose length or hash
/// do not match (a truncated or corrupted file could crash it).
fn encode_entry(key: &str, payload: &[u8]) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(payload.len() + key.len() + 40);
    bytes.extend_from_slice(CACHE_MAGIC);
    bytes.extend_from_slice(&(key.len() as u32).to_le_bytes());
    bytes.extend_from_slice(key.as_bytes());
    bytes.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    bytes.extend_from_slice(&fnv1a(&[payload]).to_le_bytes());
    bytes.extend_from_slice(payload);
    bytes
}

/// The payload of an entry written by [`encode_entry`] for `key`, or why it
/// is not one.
fn decode_entry<'a>(bytes: &'a [u8], key: &str) -> Result<&'a [u8], String> {
    fn take<'b>(bytes: &mut &'b [u8], n: usize) -> Result<&'b [u8], String> {
        if bytes.len() < n {
            return Err("truncated header".to_string());
        }
        let (head, rest) = bytes.split_at(n);
        *bytes = rest;
        Ok(head)
    }
    fn word<const N: usize>(bytes: &mut &[u8]) -> Result<[u8; N], String> {
        take(bytes, N).map(|b| b.try_into().expect("N bytes"))
    }
    let mut rest = bytes;
    if take(&mut rest, CACHE_MAGIC.len())? != CACHE_MAGIC {
        return Err("not an oxidiff cache entry of this version".to_string());
    }
    let key_len = u32::from_le_bytes(word(&mut rest)?) as usize;
    if take(&mut rest, key_len)? != key.as_bytes() {
        return Err("written for another module or plugin (stale)".to_string());
    }
    let len = u64::from_le_bytes(word(&mut rest)?);
    let hash = u64::from_le_bytes(word(&mut rest)?);
    if rest.len() as u64 != len {
        return Err(format!(
            "truncated or padded: {} payload bytes, the header says {len}",
            rest.len()
        ));
    }
    if fnv1a(&[rest]) != hash {
        return Err("corrupt: the payload's checksum does not match".to_string());
    }
    Ok(rest)
}

/// Where the entry of `key` lives in `dir`.
pub(crate) fn entry_path(dir: &Path, key: &str) -> PathBuf {
    dir.join(format!("{key}.pjrt"))
}

/// The executable cached at `path`: `Ok(None)` when there is no entry,
/// `Err(why)` when there is one that cannot be used.
pub(crate) fn load_executable(
    path: &Path,
    key: &str,
    client: &pjrt::Client,
    outputs: usize,
) -> Result<Option<LoadedExecutable>, String> {
    let bytes = match std::fs::read(path) {
        Ok(bytes) => bytes,
        // No entry, or no cache folder yet (a path through a file is reported when storing).
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory
            ) =>
        {
            return Ok(None)
        }
        Err(e) => return Err(format!("unreadable ({e})")),
    };
    let payload = decode_entry(&bytes, key)?;
    let exe = client
        .deserialize_and_load(payload)
        .map_err(|e| format!("the plugin did not load it ({e})"))?;
    if exe.num_outputs() != outputs {
        return Err(format!(
            "it has {} outputs, the program {outputs}",
            exe.num_outputs()
        ));
    }
    Ok(Some(exe))
}

/// The executable of a small program (`module`, with `outputs` results) on `device`: loaded from
/// `disk` when an earlier process stored it, else compiled and stored there (a damaged entry is
/// compiled again; a failed store only costs a compile later). Returns whether it came from
/// the disk.
pub(crate) fn load_or_compile(
    client: &pjrt::Client,
    device: &pjrt::Device,
    module: &str,
    disk: Option<&Path>,
    outputs: usize,
) -> pjrt::Result<(LoadedExecutable, bool)> {
    let key = disk_key(module, client, device.id());
    let path = disk.map(|dir| entry_path(dir, &key));
    if let Some(path) = &path {
        match load_executable(path, &key, client, outputs) {
            Ok(Some(exe)) => return Ok((exe, true)),
            Ok(None) => {}
            Err(why) => {
                let _ = std::fs::remove_file(path);
                eprintln!(
                    "oxidiff: warning: the cached executable {}: {why}; rebuilt",
                    path.display()
                );
            }
        }
    }
    let options = pjrt::CompileOptions::on_device(i64::from(device.id()));
    let exe = client.compile(module, &options)?;
    if let Some(path) = &path {
        if let Err(e) = store_executable(path, &key, &exe) {
            eprintln!(
                "oxidiff: warning: the compile cache could not store {}: {e}",
                path.display()
            );
        }
    }
    Ok((exe, false))
}

/// Writes `exe` to `path` (through a temporary file, so a reader never sees
/// half a file). A failure only costs a compile later; the caller says so.
pub(crate) fn store_executable(
    path: &Path,
    key: &str,
    exe: &LoadedExecutable,
) -> Result<(), String> {
    let bytes = encode_entry(key, &exe.serialize().map_err(|e| e.to_string())?);
    write_whole(path, &bytes)
}

/// Writes `bytes` to `path` (its folder created if missing) through a temporary file renamed
/// over it, so a reader, in this process or another, never sees half a file.
fn write_whole(path: &Path, bytes: &[u8]) -> Result<(), String> {
    let dir = path.parent().ok_or("no directory")?;
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, bytes).map_err(|e| e.to_string())?;
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        e.to_string()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_entries_round_trip_and_damage_is_detected() {
        let payload: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
        let entry = encode_entry("k1", &payload);
        assert_eq!(decode_entry(&entry, "k1").unwrap(), &payload[..]);
        assert!(decode_entry(&entry, "k2").unwrap_err().contains("stale"));
        assert!(decode_entry(&entry[..entry.len() - 1], "k1")
            .unwrap_err()
            .contains("truncated"));
        assert!(decode_entry(&entry[..10], "k1").is_err());
        let mut flipped = entry.clone();
        *flipped.last_mut().unwrap() ^= 1;
        assert!(decode_entry(&flipped, "k1")
            .unwrap_err()
            .contains("corrupt"));
        assert!(decode_entry(b"garbage", "k1").is_err());
    }

    #[test]
    fn warm_lists_keep_the_most_recent_keys_and_skip_damaged_lines() {
        let dir = std::env::temp_dir().join(format!("oxidiff-warm-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let key = |i: u64| format!("{i:016x}-{:016x}", 7);
        for i in 0..10 {
            remember_warm(&dir, "unet", &key(i), 1).unwrap();
        }
        // Used again: moves to the end, listed once.
        remember_warm(&dir, "unet", &key(4), 1).unwrap();
        remember_warm(&dir, "vae", &key(99), 2).unwrap();
        let path = warm_list_path(&dir, "unet");
        let text = std::fs::read_to_string(&path).unwrap();
        let keys: Vec<String> = parse_warm_list(&text).into_iter().map(|(k, _)| k).collect();
        let expected: Vec<String> = [2, 3, 5, 6, 7, 8, 9, 4].into_iter().map(key).collect();
        assert_eq!(keys, expected);
        assert_eq!(
            parse_warm_list(&std::fs::read_to_string(warm_list_path(&dir, "vae")).unwrap()),
            vec![(key(99), 2)]
        );
        // Damaged lines are skipped, the rest kept.
        std::fs::write(
            &path,
            format!("garbage\n{} 3\n../../etc 1\n{} x\n", key(1), key(2)),
        )
        .unwrap();
        assert_eq!(
            parse_warm_list(&std::fs::read_to_string(&path).unwrap()),
            vec![(key(1), 3)]
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
