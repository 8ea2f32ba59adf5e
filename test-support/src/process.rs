//! Processes in tests: a deadline against hangs (instead of timing assertions) and a child
//! process for a test that needs environment variables (instead of `std::env::set_var`).

use std::ffi::OsStr;
use std::process::Command;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

/// The variable that tells a child process of [`isolated`] which test it runs.
const CHILD_ENV: &str = "OXIDIFF_TEST_CHILD";

/// What a [`Deadline`] does when it passes.
enum OnTimeout {
    /// Ends this process (the test binary): the hang is in work that cannot be interrupted.
    ExitProcess,
    /// Kills the child process with this id, so that the test's own checks of it fail.
    KillChild(u32),
}

/// A watchdog: if it is not dropped within its limit, the work it guards counts as hung, a
/// message says so, and the test fails (the child is killed, or the test process exits). The
/// limit is generous: it catches hangs, it does not measure speed.
pub struct Deadline {
    done: Option<mpsc::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Deadline {
    /// Ends the test process with a failure when `what` is still running after `limit`.
    pub fn exit_process(what: &str, limit: Duration) -> Self {
        Self::start(what, limit, OnTimeout::ExitProcess)
    }

    /// Kills child `pid` when `what` is still running after `limit`.
    pub fn kill_child(what: &str, limit: Duration, pid: u32) -> Self {
        Self::start(what, limit, OnTimeout::KillChild(pid))
    }

    fn start(what: &str, limit: Duration, action: OnTimeout) -> Self {
        let (done, wait) = mpsc::channel::<()>();
        let what = what.to_string();
        let thread = std::thread::spawn(move || {
            if wait.recv_timeout(limit) != Err(mpsc::RecvTimeoutError::Timeout) {
                return;
            }
            eprintln!("{what}: still running after {limit:?}, counted as hung");
            match action {
                OnTimeout::ExitProcess => std::process::exit(101),
                OnTimeout::KillChild(pid) => {
                    let _ = Command::new("kill")
                        .args(["-KILL", &pid.to_string()])
                        .status();
                }
            }
        });
        Self {
            done: Some(done),
            thread: Some(thread),
        }
    }
}

impl Drop for Deadline {
    fn drop(&mut self) {
        if let Some(done) = self.done.take() {
            let _ = done.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Runs test `name` of this test binary again, alone, in a child process with `envs` set, so
/// the variables the library reads never reach the other tests of this binary (which run on
/// threads of one process). Returns `true` in the child: run the test's body. Returns `false`
/// in the parent once the child passed, and panics with the child's output when it failed.
///
/// `name` is the test's path in its binary (`module::test_name` for a test in a module).
pub fn isolated<K: AsRef<OsStr>, V: AsRef<OsStr>>(name: &str, envs: &[(K, V)]) -> bool {
    if std::env::var_os(CHILD_ENV).is_some_and(|v| v == name) {
        return true;
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let out = Command::new(exe)
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, name)
        .envs(envs.iter().map(|(k, v)| (k.as_ref(), v.as_ref())))
        .output()
        .unwrap_or_else(|e| panic!("{name}: starting the child process: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprint!("{stderr}");
    assert!(
        out.status.success(),
        "{name} in a child process: {}\n{stdout}",
        out.status
    );
    // The filter matched this very test (a wrong name would run nothing and pass).
    assert!(
        stdout.contains("test result: ok. 1 passed"),
        "{name}: the child process ran no test of that name\n{stdout}"
    );
    false
}
