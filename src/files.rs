//! Reading files a user names (`--latents`, `--from-png`) safely: only regular files, and at
//! most a stated number of bytes, so a FIFO cannot hang a run and `/dev/zero` or a huge file
//! cannot fill the memory.

use std::io::Read;
use std::path::{Path, PathBuf};

/// Why an input file was refused or could not be read.
#[derive(Debug, thiserror::Error)]
pub enum InputError {
    #[error("cannot read {what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("give {what} a regular file: {path} is a {kind}")]
    NotAFile {
        what: &'static str,
        path: PathBuf,
        kind: &'static str,
    },
    #[error("{what} {path} is larger than {limit} bytes, more than any such file needs")]
    TooLarge {
        what: &'static str,
        path: PathBuf,
        limit: u64,
    },
}

/// The bytes of the regular file `path` (`what` names it in errors, e.g. "latents file"), at
/// most `limit` of them. FIFOs, sockets and devices are refused before they are opened.
pub fn read_limited(path: &Path, limit: u64, what: &'static str) -> Result<Vec<u8>, InputError> {
    let io = |source| InputError::Io {
        what,
        path: path.to_path_buf(),
        source,
    };
    let check = |meta: &std::fs::Metadata| -> Result<(), InputError> {
        let kind = file_kind(meta);
        if kind != "regular file" {
            return Err(InputError::NotAFile {
                what,
                path: path.to_path_buf(),
                kind,
            });
        }
        if meta.len() > limit {
            return Err(InputError::TooLarge {
                what,
                path: path.to_path_buf(),
                limit,
            });
        }
        Ok(())
    };
    check(&std::fs::metadata(path).map_err(io)?)?;
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    {
        // A file swapped for a FIFO after the check must not block the open.
        use std::os::unix::fs::OpenOptionsExt;
        options.custom_flags(libc::O_NONBLOCK);
    }
    let file = options.open(path).map_err(io)?;
    check(&file.metadata().map_err(io)?)?;
    let mut bytes = Vec::new();
    file.take(limit.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(io)?;
    if bytes.len() as u64 > limit {
        return Err(InputError::TooLarge {
            what,
            path: path.to_path_buf(),
            limit,
        });
    }
    Ok(bytes)
}

/// Checks that `path` is a regular file without reading it (for files read by other code,
/// such as memory-mapped safetensors).
pub fn check_regular(path: &Path, what: &'static str) -> Result<(), InputError> {
    let meta = std::fs::metadata(path).map_err(|source| InputError::Io {
        what,
        path: path.to_path_buf(),
        source,
    })?;
    match file_kind(&meta) {
        "regular file" => Ok(()),
        kind => Err(InputError::NotAFile {
            what,
            path: path.to_path_buf(),
            kind,
        }),
    }
}

fn file_kind(meta: &std::fs::Metadata) -> &'static str {
    let t = meta.file_type();
    if t.is_file() {
        return "regular file";
    }
    if t.is_dir() {
        return "folder";
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return "FIFO (named pipe)";
        }
        if t.is_char_device() {
            return "character device";
        }
        if t.is_block_device() {
            return "block device";
        }
        if t.is_socket() {
            return "socket";
        }
    }
    "special file"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_and_large_files_are_refused_and_small_ones_read() {
        let err = read_limited(Path::new("/dev/zero"), 1 << 20, "latents file").unwrap_err();
        assert!(err.to_string().contains("character device"), "{err}");
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("x.npy");
        std::fs::write(&file, [0u8; 100]).unwrap();
        assert_eq!(read_limited(&file, 100, "latents file").unwrap().len(), 100);
        let err = read_limited(&file, 99, "latents file").unwrap_err();
        assert!(matches!(err, InputError::TooLarge { .. }), "{err}");
        let err = read_limited(tmp.path(), 99, "latents file").unwrap_err();
        assert!(err.to_string().contains("folder"), "{err}");
    }
}
