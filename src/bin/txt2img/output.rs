//! Output files: one file, numbered siblings of it, or numbered files in a folder, planned and
//! checked before the model loads and each created exclusively as it is written.

use std::path::{Path, PathBuf};

use anyhow::Result;
use oxidiff::cli::output::OutputError;
use oxidiff::cli::output::{check_writable, parent_dir, write_new, Existing, NumberedFiles};

use crate::args::OutputKind;

/// Where the images go.
pub enum Outputs {
    /// `output` itself, or `stem-i.ext` beside it for several images.
    Files {
        paths: Vec<PathBuf>,
        existing: Existing,
    },
    /// Numbered files in a folder after the highest number there; each takes the next free
    /// number when it is written, so concurrent runs into one folder never collide.
    Numbered { files: NumberedFiles, count: usize },
}

impl Outputs {
    /// Plans `count` outputs at `output` and checks them: the folder exists and is writable,
    /// and (unless `force`) no named file exists yet.
    pub fn plan(output: &Path, count: usize, force: bool, kind: OutputKind) -> Result<Self> {
        let ext = kind.extension();
        let is_dir = output.is_dir() || output.as_os_str().to_string_lossy().ends_with('/');
        if is_dir {
            let files = NumberedFiles::in_folder(output, ext)?;
            return Ok(Self::Numbered { files, count });
        }
        if output.extension().and_then(|e| e.to_str()) != Some(ext) {
            let kind = format!("{kind:?}").to_lowercase();
            anyhow::bail!(
                "--output must name a .{ext} file or a folder for --output-type {kind}, got {}",
                output.display()
            );
        }
        check_writable(parent_dir(output))?;
        let paths: Vec<PathBuf> = if count == 1 {
            vec![output.to_path_buf()]
        } else {
            let stem = output
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            (0..count)
                .map(|i| output.with_file_name(format!("{stem}-{i}.{ext}")))
                .collect()
        };
        let existing = if force {
            Existing::Replace
        } else {
            if let Some(path) = paths.iter().find(|p| p.exists()) {
                return Err(OutputError::Exists { path: path.clone() }.into());
            }
            Existing::Keep
        };
        Ok(Self::Files { paths, existing })
    }

    /// How many files will be written.
    pub fn len(&self) -> usize {
        match self {
            Self::Files { paths, .. } => paths.len(),
            Self::Numbered { count, .. } => *count,
        }
    }

    /// Writes output `i`'s bytes and returns the path they went to.
    pub fn write(&mut self, i: usize, bytes: &[u8]) -> Result<PathBuf, OutputError> {
        match self {
            Self::Files { paths, existing } => {
                write_new(&paths[i], bytes, *existing)?;
                Ok(paths[i].clone())
            }
            Self::Numbered { files, .. } => files.write(bytes),
        }
    }
}

pub fn display(path: &Path) -> String {
    path.display().to_string()
}
