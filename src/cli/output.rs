//! Output files: each created exclusively, so that two runs never overwrite each other's image
//! (only `--force` replaces a file), and numbered files in a folder that stay race-free between
//! processes by taking the next free number when one is taken meanwhile.

use std::io::Write;
use std::path::{Path, PathBuf};

/// Why an output could not be planned or written.
#[derive(Debug, thiserror::Error)]
pub enum OutputError {
    #[error("{path} already exists; pass --force to overwrite it or choose another --output")]
    Exists { path: PathBuf },
    #[error("create the folder {dir} first or choose another --output: it does not exist")]
    NoFolder { dir: PathBuf },
    #[error("choose another --output: {dir} is not a writable folder ({source})")]
    NotWritable {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// The folder a file output goes into (`.` for a bare file name).
pub fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    }
}

/// Checks that `dir` exists and that a file can be created in it, by creating and removing a
/// probe file; called before the model loads so a bad `--output` fails at once.
pub fn check_writable(dir: &Path) -> Result<(), OutputError> {
    if !dir.is_dir() {
        return Err(OutputError::NoFolder {
            dir: dir.to_path_buf(),
        });
    }
    let probe = dir.join(format!(".oxidiff-probe-{}", std::process::id()));
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&probe)
    {
        Ok(_) => {
            let _ = std::fs::remove_file(&probe);
            Ok(())
        }
        Err(source) => Err(OutputError::NotWritable {
            dir: dir.to_path_buf(),
            source,
        }),
    }
}

/// How an existing file at the output path is treated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Existing {
    /// Refuse it ([`OutputError::Exists`]).
    Keep,
    /// Replace it (`--force`).
    Replace,
}

/// Writes `bytes` to `path` whole or not at all: to a temporary file beside it first, then
/// linked to `path` only if no file is there (atomic and exclusive), or renamed over it with
/// [`Existing::Replace`]. A reader never sees half a file.
pub fn write_new(path: &Path, bytes: &[u8], existing: Existing) -> Result<(), OutputError> {
    let write_err = |source| OutputError::Write {
        path: path.to_path_buf(),
        source,
    };
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "output".into());
    let tmp = parent_dir(path).join(format!(".{name}.{}.tmp", std::process::id()));
    let written = (|| {
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)?;
        file.write_all(bytes)?;
        file.sync_all()
    })();
    if let Err(source) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(write_err(source));
    }
    let placed = match existing {
        Existing::Replace => std::fs::rename(&tmp, path),
        Existing::Keep => match std::fs::hard_link(&tmp, path) {
            // Without hard links (some network and FAT file systems): create the file itself
            // exclusively and copy the bytes in.
            Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists && !path.exists() => {
                copy_exclusive(bytes, path)
            }
            other => other,
        },
    };
    let _ = std::fs::remove_file(&tmp);
    match placed {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Err(OutputError::Exists {
            path: path.to_path_buf(),
        }),
        Err(source) => Err(write_err(source)),
    }
}

fn copy_exclusive(bytes: &[u8], path: &Path) -> std::io::Result<()> {
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)?;
    let result = file.write_all(bytes).and_then(|()| file.sync_all());
    if result.is_err() {
        let _ = std::fs::remove_file(path);
    }
    result
}

/// Numbered files `00000.png`, `00001.png`, ... in a folder, after the highest number there.
#[derive(Debug, Clone)]
pub struct NumberedFiles {
    dir: PathBuf,
    extension: &'static str,
    next: u64,
}

impl NumberedFiles {
    /// Creates `dir` if needed, checks it is writable and finds the first free number.
    pub fn in_folder(dir: &Path, extension: &'static str) -> Result<Self, OutputError> {
        std::fs::create_dir_all(dir).map_err(|source| match dir.parent() {
            Some(parent) if !parent.as_os_str().is_empty() && !parent.exists() => {
                OutputError::NoFolder {
                    dir: parent.to_path_buf(),
                }
            }
            _ => OutputError::NotWritable {
                dir: dir.to_path_buf(),
                source,
            },
        })?;
        check_writable(dir)?;
        let next = std::fs::read_dir(dir)
            .map_err(|source| OutputError::NotWritable {
                dir: dir.to_path_buf(),
                source,
            })?
            .filter_map(|entry| {
                let name = entry.ok()?.file_name().into_string().ok()?;
                let stem = name
                    .strip_suffix(".png")
                    .or_else(|| name.strip_suffix(".npy"))?;
                stem.parse::<u64>().ok()
            })
            .max()
            .map_or(0, |n| n.saturating_add(1));
        Ok(Self {
            dir: dir.to_path_buf(),
            extension,
            next,
        })
    }

    /// The path the next file will probably get (another process may take it first).
    pub fn peek(&self, offset: u64) -> PathBuf {
        self.path(self.next.saturating_add(offset))
    }

    fn path(&self, n: u64) -> PathBuf {
        self.dir.join(format!("{n:05}.{}", self.extension))
    }

    /// Writes `bytes` under the next free number and returns the path: when another process
    /// took that number meanwhile, the one after it is tried.
    pub fn write(&mut self, bytes: &[u8]) -> Result<PathBuf, OutputError> {
        loop {
            let path = self.path(self.next);
            self.next = self.next.saturating_add(1);
            match write_new(&path, bytes, Existing::Keep) {
                Ok(()) => return Ok(path),
                Err(OutputError::Exists { .. }) => continue,
                Err(e) => return Err(e),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_is_written_once_and_replaced_only_when_asked() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("a.png");
        write_new(&path, b"one", Existing::Keep).unwrap();
        let again = write_new(&path, b"two", Existing::Keep).unwrap_err();
        assert!(matches!(again, OutputError::Exists { .. }), "{again}");
        assert_eq!(std::fs::read(&path).unwrap(), b"one");
        write_new(&path, b"two", Existing::Replace).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
        let names: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().collect();
        assert_eq!(names.len(), 1, "no temporary file is left: {names:?}");
    }

    #[test]
    fn numbered_files_skip_a_number_taken_meanwhile() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join("00004.png"), b"old").unwrap();
        let mut files = NumberedFiles::in_folder(tmp.path(), "png").unwrap();
        assert_eq!(files.peek(0), tmp.path().join("00005.png"));
        // Another process writes 00005 after this one looked.
        std::fs::write(tmp.path().join("00005.png"), b"theirs").unwrap();
        assert_eq!(files.write(b"ours").unwrap(), tmp.path().join("00006.png"));
        assert_eq!(
            std::fs::read(tmp.path().join("00005.png")).unwrap(),
            b"theirs"
        );
    }

    #[test]
    fn a_missing_or_read_only_folder_is_named() {
        let tmp = tempfile::tempdir().unwrap();
        let missing = tmp.path().join("no/such");
        let err = check_writable(&missing).unwrap_err();
        assert!(matches!(err, OutputError::NoFolder { .. }), "{err}");
        assert!(err.to_string().contains("no/such"), "{err}");
    }
}
