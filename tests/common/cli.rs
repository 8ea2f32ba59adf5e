//! Running the binaries under test, and copying fixture folders to damage.

use std::ffi::OsStr;
use std::path::Path;
use std::process::{Command, Output};

/// `txt2img ARGS` offline, with no Hub cache from the caller's environment and oxidiff's own
/// caches (the model hashes) under the target folder, not the user's.
pub fn txt2img<S: AsRef<OsStr>>(args: &[S]) -> Output {
    txt2img_env(args, &[])
}

/// [`txt2img`] with `envs` set for the child only.
pub fn txt2img_env<S: AsRef<OsStr>>(args: &[S], envs: &[(&str, &Path)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_txt2img"));
    cmd.args(args)
        .env("HF_HUB_OFFLINE", "1")
        .env_remove("HF_HUB_CACHE")
        .env(
            "OXIDIFF_CACHE_DIR",
            Path::new(env!("CARGO_TARGET_TMPDIR")).join("oxidiff-cache"),
        );
    for (k, v) in envs {
        cmd.env(k, v);
    }
    cmd.output().expect("txt2img runs")
}

/// A child's stderr as text.
pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Copies the folder `from` to `to`, recursively, following links (some fixtures link the
/// components they share with another fixture): a fixture model to damage or rearrange.
pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.path().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// The file names in `dir`, sorted (what a run left behind).
pub fn files_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}
