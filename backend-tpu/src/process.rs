//! State the process holds once: the PJRT plugins and their clients, each device's router
//! client, the CPU device's tensor ids, the recordings of traces, the compile count.
//!
//! A program usually holds one copy of this crate, and a `static` would do. But evcxr (the
//! notebooks' Rust kernel) builds every cell into its own library with its own copy of the
//! dependencies, so each `static` exists once per cell: a pipeline moved to a device in one
//! cell would hold tensors of a client the next cell's copy does not know, and a trace started
//! by one copy would not see the ops another copy's eager client hands it. So each piece of
//! such state is made by the first copy that asks for it and found by the others: the first
//! copy publishes the address of a registry in an environment variable (with the process id,
//! so a child process does not trust it), and every copy of the same build (the same
//! `TypeId`s) looks its state up there by type. A copy of another build gets its own.

use std::any::TypeId;
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

/// Where the first copy publishes the registry: `"{pid} {address} {type tag}"`.
const ENV: &str = "OXIDIFF_PROCESS_STATE";

/// The leaked, never freed values of [`shared`], by the `TypeId` of their type.
#[derive(Default)]
struct Registry {
    entries: Mutex<HashMap<String, usize>>,
}

fn type_tag<T: 'static>() -> String {
    format!("{:?}", TypeId::of::<T>())
}

fn registry() -> &'static Registry {
    static LOCAL: OnceLock<&'static Registry> = OnceLock::new();
    LOCAL.get_or_init(|| {
        let pid = std::process::id();
        let tag = type_tag::<Registry>();
        if let Ok(value) = std::env::var(ENV) {
            let mut parts = value.splitn(3, ' ');
            let (p, address, t) = (parts.next(), parts.next(), parts.next());
            if p == Some(pid.to_string().as_str()) && t == Some(tag.as_str()) {
                if let Some(address) = address.and_then(|a| a.parse::<usize>().ok()) {
                    // SAFETY: this process published `address` below, from a copy of this
                    // crate of the same build (the same type tag): a leaked `Registry`.
                    return unsafe { &*(address as *const Registry) };
                }
            }
        }
        let registry: &'static Registry = Box::leak(Box::default());
        let address = registry as *const Registry as usize;
        // SAFETY: `set_var` must not race with another thread reading the environment through
        // libc. This runs once per process, on the first use of shared state, which precedes
        // loading any PJRT plugin (the plugin registry is shared state) and so any thread of
        // one; Rust's own readers are serialised by std.
        unsafe { std::env::set_var(ENV, format!("{pid} {address} {tag}")) };
        registry
    })
}

/// The process's one `T`, made by `init` on first use. `init` must not call `shared` (the
/// registry is locked meanwhile). Callers keep the reference in a `static` `OnceLock` of
/// their own, so the registry is asked once per copy.
pub(crate) fn shared<T: Send + Sync + 'static>(init: impl FnOnce() -> T) -> &'static T {
    let mut entries = registry()
        .entries
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let address = *entries
        .entry(type_tag::<T>())
        .or_insert_with(|| Box::leak(Box::new(init())) as *const T as usize);
    // SAFETY: stored under `T`'s `TypeId` by a copy of this crate of the same build: a leaked
    // `T`, never freed.
    unsafe { &*(address as *const T) }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::shared;

    struct Counter(AtomicU64);

    #[test]
    fn one_value_per_type_for_the_whole_process() {
        let a = shared(|| Counter(AtomicU64::new(7)));
        a.0.fetch_add(1, Ordering::Relaxed);
        let b = shared(|| Counter(AtomicU64::new(0)));
        assert!(std::ptr::eq(a, b));
        assert!(b.0.load(Ordering::Relaxed) >= 8);
        let published = std::env::var(super::ENV).unwrap();
        assert!(published.starts_with(&format!("{} ", std::process::id())));
    }
}
