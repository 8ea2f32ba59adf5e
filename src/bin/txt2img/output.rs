//! Output paths: a file, numbered siblings of it, or numbered files in a folder.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use crate::args::OutputKind;

/// Where the images go: `output` itself, `stem-i.png` beside it for several images, or numbered
/// files in a folder after the highest number already there. Existing files are refused unless
/// `force`, before anything is generated.
pub fn output_paths(
    output: &Path,
    count: usize,
    force: bool,
    kind: OutputKind,
) -> Result<Vec<PathBuf>> {
    let ext = kind.extension();
    let is_dir = output.is_dir() || output.as_os_str().to_string_lossy().ends_with('/');
    let paths: Vec<PathBuf> = if is_dir {
        std::fs::create_dir_all(output)
            .with_context(|| format!("creating the output folder {}", output.display()))?;
        let next = std::fs::read_dir(output)
            .with_context(|| format!("reading the output folder {}", output.display()))?
            .filter_map(|entry| {
                let name = entry.ok()?.file_name().into_string().ok()?;
                let stem = name
                    .strip_suffix(".png")
                    .or_else(|| name.strip_suffix(".npy"))?;
                stem.parse::<u64>().ok()
            })
            .max()
            .map_or(0, |n| n + 1);
        (0..count as u64)
            .map(|i| output.join(format!("{:05}.{ext}", next + i)))
            .collect()
    } else {
        if output.extension().and_then(|e| e.to_str()) != Some(ext) {
            let kind = format!("{kind:?}").to_lowercase();
            bail!(
                "--output must name a .{ext} file or a folder for --output-type {kind}, got {}",
                output.display()
            );
        }
        if count == 1 {
            vec![output.to_path_buf()]
        } else {
            let stem = output
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            (0..count)
                .map(|i| output.with_file_name(format!("{stem}-{i}.{ext}")))
                .collect()
        }
    };
    if !force {
        if let Some(existing) = paths.iter().find(|p| p.exists()) {
            bail!(
                "{} already exists; pass --force to overwrite it or choose another --output",
                existing.display()
            );
        }
    }
    Ok(paths)
}

pub fn display(path: &Path) -> String {
    path.display().to_string()
}
