//! Copies of weights in a kernel's own form (packed for a product, transformed for Winograd),
//! made once per weight and kept while the weight lives, instead of on every call.
//!
//! Entries are keyed by the weight's storage and layout and hold the storage only weakly, so
//! one is dropped once its weight is gone (at the next insertion). burn-flex writes in place
//! only through storage nobody else references (`Arc::get_mut`, `Arc::make_mut`), so a weight
//! changed in place moves to new storage and gets a new copy.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use burn::tensor::Bytes;
use burn_flex::FlexTensor;

/// Where a weight's values lie: its storage, and its layout in it.
#[derive(Clone, PartialEq, Eq, Hash)]
struct WeightKey {
    storage: usize,
    offset: usize,
    shape: Vec<usize>,
    strides: Vec<isize>,
}

struct Entry<T> {
    owner: Weak<Bytes>,
    value: Arc<T>,
}

/// One kernel's copies, by weight (a `static`).
pub(crate) struct WeightCache<T> {
    entries: Mutex<Option<HashMap<WeightKey, Entry<T>>>>,
}

impl<T> WeightCache<T> {
    pub(crate) const fn new() -> Self {
        Self {
            entries: Mutex::new(None),
        }
    }

    /// The copy of `weight`, made by `make` unless this storage and layout already have one.
    pub(crate) fn get_or_make(&self, weight: &FlexTensor, make: impl FnOnce() -> T) -> Arc<T> {
        let storage = weight.data_arc();
        let layout = weight.layout();
        let key = WeightKey {
            storage: Arc::as_ptr(&storage) as usize,
            offset: layout.start_offset(),
            shape: layout.shape().to_vec(),
            strides: layout.strides().to_vec(),
        };
        {
            let entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(entry) = entries.as_ref().and_then(|c| c.get(&key)) {
                if entry
                    .owner
                    .upgrade()
                    .is_some_and(|o| Arc::ptr_eq(&o, &storage))
                {
                    return entry.value.clone();
                }
            }
        }
        let value = Arc::new(make());
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        let entries = entries.get_or_insert_with(HashMap::new);
        entries.retain(|_, entry| entry.owner.strong_count() > 0);
        entries.insert(
            key,
            Entry {
                owner: Arc::downgrade(&storage),
                value: value.clone(),
            },
        );
        value
    }
}
