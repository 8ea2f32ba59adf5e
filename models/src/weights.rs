//! Checkpoint weights: memory-mapped safetensors files and a key-path builder.
//!
//! A [`Weights`] holds every tensor of one component folder (a single file, a `.fp16` variant,
//! or shards listed in `*.safetensors.index.json`). A [`VarBuilder`] walks key paths the way the
//! checkpoint names them (`down_blocks.0.resnets.0.conv1.weight`), so each layer is built straight
//! from its weights, with the expected shape checked. A tensor stored in the dtype it is held in
//! is the mapped file itself; any other is converted once ([`crate::weight_data`]).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use burn::tensor::{FloatDType, TensorData};
use memmap2::Mmap;
use safetensors::tensor::{Dtype, TensorInfo};
use safetensors::SafeTensors;

use crate::error::{ModelError, Result};
use crate::gguf::{GgmlType, GgufFile, QuantizedMatrix};
use crate::weight_data::{self, Stored};

/// The largest [`Weights::from_header`] file: safetensors' own limit on a header.
const MAX_HEADER_FILE: u64 = 100_000_000;

/// One memory-mapped safetensors file with its parsed and validated header.
struct WeightFile {
    path: PathBuf,
    mmap: Mmap,
    data_start: usize,
    /// A header without its data ([`Weights::from_header`]): every value is zero, and a tensor
    /// read is made zero in the dtype asked for, nothing converted.
    zeros: bool,
}

impl WeightFile {
    /// The weights file at `path`, mapped as `mmap`, entered in [`FILE_MAPS`].
    fn of_file(path: PathBuf, mmap: Mmap, data_start: usize) -> Arc<Self> {
        let file = Arc::new(Self {
            path,
            mmap,
            data_start,
            zeros: false,
        });
        let mut maps = FILE_MAPS.lock().unwrap_or_else(|e| e.into_inner());
        maps.retain(|map| map.strong_count() > 0);
        maps.push(Arc::downgrade(&file));
        file
    }
}

/// Every live weights file's map (not the anonymous maps of [`Weights::shapes_only`] and
/// [`Weights::from_header`]), so that a kernel holding a weight's bytes can tell whether they
/// lie in one ([`is_mapped`], [`release_if_mapped`]).
static FILE_MAPS: Mutex<Vec<std::sync::Weak<WeightFile>>> = Mutex::new(Vec::new());

/// The live weights file whose map holds all of `bytes` (none for empty bytes), and their
/// offset in it.
fn file_holding(bytes: &[u8]) -> Option<(Arc<WeightFile>, usize)> {
    let start = bytes.as_ptr() as usize;
    let end = start + bytes.len();
    let maps = FILE_MAPS.lock().unwrap_or_else(|e| e.into_inner());
    maps.iter()
        .filter_map(std::sync::Weak::upgrade)
        .find(|file| {
            let map = file.mmap.as_ptr() as usize;
            !bytes.is_empty() && map <= start && end <= map + file.mmap.len()
        })
        .map(|file| {
            let offset = start - file.mmap.as_ptr() as usize;
            (file, offset)
        })
}

/// Whether `bytes` lie inside a live weights file's map (a tensor held as the mapped file
/// itself), so that [`release_if_mapped`] would hand them back.
pub(crate) fn is_mapped(bytes: &[u8]) -> bool {
    file_holding(bytes).is_some()
}

/// Hands the pages of `bytes` back to the kernel if they lie inside a live weights file's map,
/// for a kernel that keeps its own copy of a weight and no longer reads the weight itself: the
/// process's resident memory stops counting them, and a later read faults them back in from
/// the file. Bytes of any other memory are left alone.
pub(crate) fn release_if_mapped(bytes: &[u8]) {
    if let Some((file, offset)) = file_holding(bytes) {
        release(&file, offset..offset + bytes.len());
    }
}

/// Where one tensor lives.
struct Entry {
    file: usize,
    info: TensorInfo,
    /// Read as the transpose of the stored 2-D tensor (`info.shape` is the transposed shape).
    transposed: bool,
    /// GGML blocks (from a GGUF file): `info.shape` is the logical shape and `info.dtype` is
    /// `U8`; the bytes are whole rows of blocks.
    quant: Option<GgmlType>,
    /// Read with the halves of the first axis swapped ([`TensorView::SwapHalves`]).
    swap_halves: bool,
}

/// How a tensor of a [`Weights::view`] is read from its source tensor: a single-file checkpoint
/// stores some weights under another name, fused or in another shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TensorView {
    /// The source tensor as it is.
    Whole,
    /// The same values in another shape (a 1x1 convolution kernel read as a linear weight).
    Reshape(Vec<usize>),
    /// `count` rows of the first axis from `start` (one of q/k/v in a fused projection).
    Rows { start: usize, count: usize },
    /// The transpose of a 2-D tensor (OpenCLIP's `text_projection`).
    Transpose,
    /// The two halves of the first axis swapped (the original Flux checkpoints store the final
    /// modulation as `[scale, shift]`, diffusers as `[shift, scale]`); read as a copy.
    SwapHalves,
}

/// All tensors of a component, from one or more safetensors files.
pub struct Weights {
    files: Vec<Arc<WeightFile>>,
    entries: HashMap<String, Entry>,
    used: Mutex<BTreeSet<String>>,
    /// The files' `__metadata__` string maps, merged.
    metadata: BTreeMap<String, String>,
}

impl std::fmt::Debug for Weights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Weights")
            .field("files", &self.file_list())
            .field("tensors", &self.entries.len())
            .finish()
    }
}

impl Weights {
    /// Opens the weights of a component folder the way diffusers resolves them: with a
    /// `variant` (for example `fp16`) `{base}.{variant}.safetensors` is preferred, then
    /// `{base}.safetensors`, then the sharded `{base}.safetensors.index.json` (or its variant).
    /// `bases` are tried in order (`diffusion_pytorch_model`, `model`).
    pub fn from_component_dir(dir: &Path, bases: &[&str], variant: Option<&str>) -> Result<Self> {
        if !dir.is_dir() {
            return Err(ModelError::Io {
                path: dir.to_path_buf(),
                source: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "component folder not found: is this a diffusers-format model folder?",
                ),
            });
        }
        let mut tried = Vec::new();
        for base in bases {
            let mut candidates = Vec::new();
            if let Some(v) = variant {
                candidates.push(format!("{base}.{v}.safetensors"));
                candidates.push(format!("{base}.safetensors.index.{v}.json"));
                candidates.push(format!("{base}.{v}.safetensors.index.json"));
            }
            candidates.push(format!("{base}.safetensors"));
            candidates.push(format!("{base}.safetensors.index.json"));
            for name in candidates {
                let path = dir.join(&name);
                if path.is_file() {
                    if name.ends_with(".json") {
                        return Self::from_index(&path);
                    }
                    return Self::from_files(&[path]);
                }
                // Something of that name that is no regular file (a FIFO, a device, a folder):
                // reading it could block forever or never end, so it is named, not skipped.
                if let Ok(meta) = std::fs::metadata(&path) {
                    return Err(ModelError::NoWeights {
                        dir: dir.to_path_buf(),
                        expected: format!(
                            "{name} to be a regular file, but it is {}; replace it with the \
                             safetensors file",
                            file_kind(&meta)
                        ),
                    });
                }
                tried.push(name);
            }
        }
        for pickled in ["bin", "ckpt", "pt", "pth"] {
            for base in bases {
                let path = dir.join(format!("{base}.{pickled}"));
                if path.is_file() {
                    return Err(ModelError::NoWeights {
                        dir: dir.to_path_buf(),
                        expected: format!(
                            "safetensors weights; found only the pickle file {}, which oxidiff \
                             refuses to load because unpickling can execute code. Convert it to \
                             safetensors (for example with diffusers: load the pipeline, then \
                             `save_pretrained(dir, safe_serialization=True)`)",
                            path.display()
                        ),
                    });
                }
            }
        }
        Err(ModelError::NoWeights {
            dir: dir.to_path_buf(),
            expected: format!("one of {}", tried.join(", ")),
        })
    }

    /// Opens a sharded checkpoint from its `*.safetensors.index.json`.
    pub fn from_index(index: &Path) -> Result<Self> {
        #[derive(serde::Deserialize)]
        struct Index {
            weight_map: BTreeMap<String, String>,
        }
        let text = std::fs::read_to_string(index).map_err(|source| ModelError::Io {
            path: index.to_path_buf(),
            source,
        })?;
        let parsed: Index = serde_json::from_str(&text).map_err(|e| ModelError::Config {
            path: index.to_path_buf(),
            reason: e.to_string(),
        })?;
        let dir = index.parent().unwrap_or(Path::new("."));
        let mut shards: Vec<PathBuf> = Vec::new();
        for shard in parsed.weight_map.values() {
            let rel = Path::new(shard);
            // A shard name from a stranger's index must stay inside the model folder.
            if rel.is_absolute()
                || rel
                    .components()
                    .any(|c| !matches!(c, std::path::Component::Normal(_)))
            {
                return Err(ModelError::Config {
                    path: index.to_path_buf(),
                    reason: format!("shard path `{shard}` leaves the model folder"),
                });
            }
            let path = dir.join(rel);
            if !shards.contains(&path) {
                shards.push(path);
            }
        }
        let weights = Self::from_files(&shards)?;
        for key in parsed.weight_map.keys() {
            if !weights.entries.contains_key(key) {
                return Err(ModelError::MissingKey {
                    key: key.clone(),
                    files: weights.file_list(),
                });
            }
        }
        Ok(weights)
    }

    /// Opens and validates the given safetensors files (headers, offsets and lengths).
    pub fn from_files(paths: &[PathBuf]) -> Result<Self> {
        for path in paths {
            ensure_inside_model(path)?;
        }
        Self::open_checked(paths)
    }

    /// Opens one safetensors file the user named directly (a LoRA, say), with the same header
    /// check as [`from_files`](Self::from_files) but without its model-folder link rule: that
    /// rule guards against links inside a stranger's model folder, and such a file belongs to
    /// no model folder.
    pub fn from_standalone_file(path: &Path) -> Result<Self> {
        Self::open_checked(&[path.to_path_buf()])
    }

    /// Opens a GGUF file, its tensors named as in the file (diffusers' names, or the original
    /// ones a single-file rename maps). F32, F16 and BF16 tensors are read like safetensors
    /// ones; quantized 2-D weights are kept in their blocks ([`Self::quantized`]), and any other
    /// read of a quantized tensor dequantizes it.
    pub fn from_gguf(path: &Path) -> Result<Self> {
        let gguf = GgufFile::open(path)?;
        let mut entries = HashMap::new();
        for t in &gguf.tensors {
            let dtype = match t.kind {
                GgmlType::F32 => Dtype::F32,
                GgmlType::F16 => Dtype::F16,
                GgmlType::BF16 => Dtype::BF16,
                _ => Dtype::U8,
            };
            let info = TensorInfo {
                dtype,
                shape: t.shape.clone(),
                data_offsets: (t.start, t.end),
            };
            let quant = t.kind.is_quantized().then_some(t.kind);
            entries.insert(
                t.name.clone(),
                Entry {
                    file: 0,
                    info,
                    transposed: false,
                    quant,
                    swap_halves: false,
                },
            );
        }
        let metadata = gguf
            .metadata
            .iter()
            .filter_map(|(k, v)| match v {
                crate::gguf::MetaValue::Str(s) => Some((k.clone(), s.clone())),
                _ => None,
            })
            .collect();
        Ok(Self {
            files: vec![WeightFile::of_file(gguf.path, gguf.mmap, 0)],
            entries,
            used: Mutex::new(BTreeSet::new()),
            metadata,
        })
    }

    fn open_checked(paths: &[PathBuf]) -> Result<Self> {
        let mut metadata_map = BTreeMap::new();
        let mut files = Vec::with_capacity(paths.len());
        let mut entries = HashMap::new();
        for path in paths {
            let file = File::open(path).map_err(|source| ModelError::Io {
                path: path.clone(),
                source,
            })?;
            // SAFETY: the map is read-only; the file may change under us only if another process
            // rewrites it while we run, which is the same contract every mmap-based loader
            // (safetensors, candle, PyTorch) has. Tensors stored in the dtype they are held in
            // keep reading the map for as long as the model lives, so the checkpoint must not
            // be rewritten in place while it is loaded. All offsets are validated below.
            let mmap = unsafe { Mmap::map(&file) }.map_err(|source| ModelError::Io {
                path: path.clone(),
                source,
            })?;
            crate::safetensors_check::check_header(&mmap).map_err(|reason| {
                ModelError::Safetensors {
                    path: path.clone(),
                    reason,
                }
            })?;
            let (header_len, metadata) =
                SafeTensors::read_metadata(&mmap).map_err(|e| ModelError::Safetensors {
                    path: path.clone(),
                    reason: e.to_string(),
                })?;
            if let Some(meta) = metadata.metadata() {
                metadata_map.extend(meta.iter().map(|(k, v)| (k.clone(), v.clone())));
            }
            let index = files.len();
            for (name, info) in metadata.tensors() {
                if entries.contains_key(&name) {
                    return Err(ModelError::Safetensors {
                        path: path.clone(),
                        reason: format!("tensor `{name}` appears in more than one file"),
                    });
                }
                entries.insert(
                    name,
                    Entry {
                        file: index,
                        info: info.clone(),
                        transposed: false,
                        quant: None,
                        swap_halves: false,
                    },
                );
            }
            files.push(WeightFile::of_file(path.clone(), mmap, 8 + header_len));
        }
        Ok(Self {
            files,
            entries,
            used: Mutex::new(BTreeSet::new()),
            metadata: metadata_map,
        })
    }

    /// Other names for some of these tensors, sharing the same memory maps: each `(name, source,
    /// view)` makes tensor `name` read `source` through `view`. This is how a single-file
    /// checkpoint's keys are renamed to the diffusers keys the models ask for, so the models load
    /// unchanged; a source that is missing or does not fit its view is an error naming it.
    pub fn view(
        &self,
        names: impl IntoIterator<Item = (String, String, TensorView)>,
    ) -> Result<Self> {
        let mut entries = HashMap::new();
        for (name, source, view) in names {
            let entry = self
                .entries
                .get(&source)
                .ok_or_else(|| ModelError::MissingKey {
                    key: source.clone(),
                    files: self.file_list(),
                })?;
            let shape = &entry.info.shape;
            let misfit = |expected: Vec<usize>| ModelError::ShapeMismatch {
                key: source.clone(),
                path: self.path_of(&source),
                expected,
                found: shape.clone(),
            };
            let mut info = entry.info.clone();
            let mut transposed = entry.transposed;
            let mut swap_halves = entry.swap_halves;
            if let Some(kind) = entry.quant {
                // Blocks run along the last axis: only whole rows can be taken or regrouped.
                let fits = match &view {
                    TensorView::Whole | TensorView::Rows { .. } | TensorView::SwapHalves => true,
                    TensorView::Reshape(new_shape) => new_shape.last() == shape.last(),
                    TensorView::Transpose => false,
                };
                if !fits {
                    return Err(ModelError::Unsupported {
                        path: self.path_of(&source),
                        reason: format!(
                            "tensor `{source}` is quantized ({kind}) and cannot be read as \
                             {view:?}: re-quantize the file from the original checkpoint"
                        ),
                    });
                }
            }
            match view {
                TensorView::Whole => {}
                TensorView::Reshape(new_shape) => {
                    if new_shape.iter().product::<usize>() != shape.iter().product::<usize>() {
                        return Err(misfit(new_shape));
                    }
                    if transposed && new_shape.len() != 2 {
                        return Err(misfit(new_shape));
                    }
                    info.shape = new_shape;
                }
                TensorView::Rows { start, count } => {
                    let rows = shape.first().copied().unwrap_or(0);
                    if transposed || swap_halves || shape.is_empty() || start + count > rows {
                        let mut expected = shape.clone();
                        if let Some(first) = expected.first_mut() {
                            *first = start + count;
                        }
                        return Err(misfit(expected));
                    }
                    let row_values = shape[1..].iter().product::<usize>();
                    let row_bytes = match entry.quant {
                        Some(kind) => {
                            let last = shape.last().copied().unwrap_or(1);
                            kind.row_bytes(last).unwrap_or(0) * (row_values / last.max(1))
                        }
                        None => row_values * info.dtype.bitsize() / 8,
                    };
                    let begin = info.data_offsets.0 + start * row_bytes;
                    info.data_offsets = (begin, begin + count * row_bytes);
                    info.shape[0] = count;
                }
                TensorView::SwapHalves => {
                    if transposed || swap_halves || shape.first().is_none_or(|r| r % 2 != 0) {
                        return Err(misfit(shape.clone()));
                    }
                    swap_halves = true;
                }
                TensorView::Transpose => {
                    if swap_halves {
                        return Err(misfit(shape.clone()));
                    }
                    if shape.len() != 2 {
                        return Err(misfit(vec![shape.iter().product(), 1]));
                    }
                    info.shape = vec![shape[1], shape[0]];
                    transposed = !transposed;
                }
            }
            entries.insert(
                name,
                Entry {
                    file: entry.file,
                    info,
                    transposed,
                    quant: entry.quant,
                    swap_halves,
                },
            );
        }
        Ok(Self {
            files: self.files.clone(),
            entries,
            used: Mutex::new(BTreeSet::new()),
            metadata: self.metadata.clone(),
        })
    }

    /// A checkpoint's names and shapes without its data, labelled `label` in messages: for
    /// inspecting a layout (detecting an architecture, inferring a config) when the bytes are
    /// not at hand. Reading a tensor from it is an error.
    pub fn shapes_only(
        label: &Path,
        shapes: impl IntoIterator<Item = (String, Vec<usize>)>,
    ) -> Result<Self> {
        let mmap = memmap2::MmapOptions::new()
            .len(1)
            .map_anon()
            .and_then(|m| m.make_read_only())
            .map_err(|source| ModelError::Io {
                path: label.to_path_buf(),
                source,
            })?;
        let tensors = shapes.into_iter().map(|(name, shape)| {
            let info = TensorInfo {
                dtype: Dtype::F32,
                shape,
                data_offsets: (0, 0),
            };
            (name, info)
        });
        Ok(Self::unmapped(label, mmap, false, tensors, BTreeMap::new()))
    }

    /// A checkpoint's tensors from its safetensors header alone (a JSON file: each tensor's
    /// dtype, shape and `data_offsets`, as the header of a `.safetensors` file holds them), with
    /// every value zero: for tracing a model's programs (ahead-of-time compiles), which need
    /// names, shapes and dtypes but never the values, without the checkpoint's bytes. A tensor
    /// read is zeros made in the dtype asked for (the allocator's zeroed pages, nothing
    /// converted or read from disk); behind the offsets is an unbacked zero mapping.
    pub fn from_header(path: &Path) -> Result<Self> {
        let invalid = |reason: String| ModelError::WeightsHeader {
            path: path.to_path_buf(),
            reason,
        };
        let io = |source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        };
        let size = std::fs::metadata(path).map_err(io)?.len();
        if size > MAX_HEADER_FILE {
            return Err(invalid(format!(
                "{size} bytes, more than a header's {MAX_HEADER_FILE}"
            )));
        }
        let text = std::fs::read_to_string(path).map_err(io)?;
        let header: safetensors::tensor::Metadata =
            serde_json::from_str(&text).map_err(|e| invalid(e.to_string()))?;
        let tensors = header.tensors();
        let data_len = tensors
            .values()
            .map(|info| info.data_offsets.1)
            .max()
            .unwrap_or(0);
        // MAP_NORESERVE: the mapping is as large as the checkpoint's data (24 GB for FLUX.1-dev
        // in bf16), but at most read, so it stays the kernel's shared zero page.
        let mmap = memmap2::MmapOptions::new()
            .len(data_len.max(1))
            .no_reserve_swap()
            .map_anon()
            .and_then(|m| m.make_read_only())
            .map_err(io)?;
        let metadata = header
            .metadata()
            .clone()
            .unwrap_or_default()
            .into_iter()
            .collect();
        let tensors = tensors.into_iter().map(|(name, info)| (name, info.clone()));
        Ok(Self::unmapped(path, mmap, true, tensors, metadata))
    }

    /// Weights of one anonymous mapping (no file's bytes) named `path` in messages, its values
    /// `zeros` ([`WeightFile::zeros`]) or not to be read.
    fn unmapped(
        path: &Path,
        mmap: Mmap,
        zeros: bool,
        tensors: impl Iterator<Item = (String, TensorInfo)>,
        metadata: BTreeMap<String, String>,
    ) -> Self {
        let entries = tensors
            .map(|(name, info)| {
                let entry = Entry {
                    file: 0,
                    info,
                    transposed: false,
                    quant: None,
                    swap_halves: false,
                };
                (name, entry)
            })
            .collect();
        Self {
            files: vec![Arc::new(WeightFile {
                path: path.to_path_buf(),
                mmap,
                data_start: 0,
                zeros,
            })],
            entries,
            used: Mutex::new(BTreeSet::new()),
            metadata,
        }
    }

    /// The files' `__metadata__` entries (string to string), merged across shards.
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }

    /// The files these weights come from, for messages.
    /// The files the tensors come from, in the order they were opened.
    pub fn paths(&self) -> Vec<PathBuf> {
        self.files.iter().map(|f| f.path.clone()).collect()
    }

    pub fn file_list(&self) -> String {
        self.files
            .iter()
            .map(|f| f.path.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Whether a tensor of this name exists.
    pub fn contains(&self, key: &str) -> bool {
        self.entries.contains_key(key)
    }

    /// All tensor names.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    /// Shape of a tensor, if present.
    pub fn shape(&self, key: &str) -> Option<&[usize]> {
        self.entries.get(key).map(|e| e.info.shape.as_slice())
    }

    /// Tensors present in the files that no layer asked for, sorted.
    pub fn unused_keys(&self) -> Vec<String> {
        let used = match self.used.lock() {
            Ok(u) => u.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        };
        let mut unused: Vec<String> = self
            .entries
            .keys()
            .filter(|k| !used.contains(*k))
            .cloned()
            .collect();
        unused.sort();
        unused
    }

    /// [`unused_keys`](Self::unused_keys) for a message: `None` when every tensor was used,
    /// else their count and the first five, quoted (`` `a`, `b` ``).
    pub fn unused_summary(&self) -> Option<(usize, String)> {
        let unused = self.unused_keys();
        if unused.is_empty() {
            return None;
        }
        let shown: Vec<String> = unused.iter().take(5).map(|k| format!("`{k}`")).collect();
        Some((unused.len(), shown.join(", ")))
    }

    /// Reads a tensor as f32 values with its shape, converting F16/BF16/F64.
    pub fn read_f32(&self, key: &str) -> Result<(Vec<f32>, Vec<usize>)> {
        if let Some(matrix) = self.quantized_any(key)? {
            let shape = self.entries[key].info.shape.clone();
            return Ok((matrix.dequantize(), shape));
        }
        let (entry, file, bytes, stored) = self.locate(key)?;
        Ok((
            f32_values(entry, file, bytes, stored),
            entry.info.shape.clone(),
        ))
    }

    /// Reads a tensor held in `dtype`, with its shape: the memory-mapped bytes themselves when
    /// the file stores it in that dtype (nothing copied), otherwise converted once from the
    /// stored type.
    pub fn read(&self, key: &str, dtype: FloatDType) -> Result<TensorData> {
        Ok(
            match self.read_deferred(key, dtype, Defer::WhenConverted)? {
                WeightRead::Ready(data) => data,
                WeightRead::Pending(pending) => pending.read(),
            },
        )
    }

    /// `key` found and checked as [`read`](Self::read) does, read now when it is no plain stored
    /// tensor (quantized blocks, a view, a header without data) or, with
    /// [`Defer::WhenConverted`], when that converts nothing (the file holds it in `dtype`: the
    /// mapped bytes are the tensor); otherwise its reading is left to [`PendingRead::read`].
    pub(crate) fn read_deferred(
        &self,
        key: &str,
        dtype: FloatDType,
        defer: Defer,
    ) -> Result<WeightRead> {
        if let Some(matrix) = self.quantized_any(key)? {
            let shape = self.entries[key].info.shape.clone();
            let data = weight_data::from_f32(matrix.dequantize(), shape, dtype);
            return Ok(WeightRead::Ready(data));
        }
        let (entry, file, bytes, stored) = self.locate(key)?;
        let shape = entry.info.shape.clone();
        if file.zeros {
            return Ok(WeightRead::Ready(weight_data::zeros(shape, dtype)));
        }
        if entry.transposed {
            let values = f32_values(entry, file, bytes, stored);
            return Ok(WeightRead::Ready(weight_data::from_f32(
                values, shape, dtype,
            )));
        }
        if entry.swap_halves {
            let swapped = swap_halves(bytes);
            let (data, _) = weight_data::tensor_data(&swapped, stored, shape, dtype, || {
                bytes::Bytes::from(swapped.clone())
            });
            return Ok(WeightRead::Ready(data));
        }
        let (start, end) = entry.info.data_offsets;
        let pending = PendingRead {
            file: file.clone(),
            range: file.data_start + start..file.data_start + end,
            stored,
            shape,
            dtype,
        };
        let ready = defer == Defer::WhenConverted && weight_data::shares(bytes, stored, dtype);
        Ok(if ready {
            WeightRead::Ready(pending.read())
        } else {
            WeightRead::Pending(pending)
        })
    }

    /// Bytes of the quantized tensors read so far, by GGML type: what a model built from these
    /// weights keeps in blocks.
    pub fn quantized_in_use(&self) -> crate::memory::QuantizedBytes {
        let mut bytes = crate::memory::QuantizedBytes::default();
        let Ok(used) = self.used.lock() else {
            return bytes;
        };
        for key in used.iter() {
            if let Some(entry) = self.entries.get(key) {
                if let Some(kind) = entry.quant {
                    let (start, end) = entry.info.data_offsets;
                    *bytes.0.entry(kind.to_string()).or_default() += end - start;
                }
            }
        }
        bytes
    }

    /// The quantized blocks of the 2-D weight `key`, shared with the file's map, or `None` when
    /// the tensor is stored as plain floats.
    pub fn quantized(&self, key: &str) -> Result<Option<QuantizedMatrix>> {
        match self.entries.get(key) {
            Some(entry) if entry.quant.is_some() && entry.info.shape.len() == 2 => {
                self.quantized_any(key)
            }
            _ => Ok(None),
        }
    }

    /// The blocks of quantized tensor `key` of any rank, seen as `[values / last, last]`;
    /// `None` for a plain one. Marks the key used.
    fn quantized_any(&self, key: &str) -> Result<Option<QuantizedMatrix>> {
        let Some(entry) = self.entries.get(key) else {
            return Err(ModelError::MissingKey {
                key: key.to_string(),
                files: self.file_list(),
            });
        };
        let Some(kind) = entry.quant else {
            return Ok(None);
        };
        let file = &self.files[entry.file];
        let cols = entry.info.shape.last().copied().unwrap_or(1);
        let rows = entry.info.shape.iter().product::<usize>() / cols.max(1);
        let (start, end) = (
            file.data_start + entry.info.data_offsets.0,
            file.data_start + entry.info.data_offsets.1,
        );
        let mut bytes = bytes::Bytes::from_owner(Mapped(file.clone())).slice(start..end);
        if entry.swap_halves {
            bytes = bytes::Bytes::from(swap_halves(&bytes));
        }
        let matrix =
            QuantizedMatrix::new(kind, rows, cols, bytes).ok_or_else(|| ModelError::Gguf {
                path: file.path.clone(),
                reason: format!(
                    "tensor `{key}` ({kind}) has {} bytes, which do not hold its shape {:?}",
                    end - start,
                    entry.info.shape
                ),
            })?;
        if let Ok(mut used) = self.used.lock() {
            used.insert(key.to_string());
        }
        Ok(Some(matrix))
    }

    /// The entry of `key`, its file, its bytes in the map and their stored type; marks the key
    /// used. The byte count is checked against the shape.
    fn locate(&self, key: &str) -> Result<(&Entry, &Arc<WeightFile>, &[u8], Stored)> {
        let entry = self
            .entries
            .get(key)
            .ok_or_else(|| ModelError::MissingKey {
                key: key.to_string(),
                files: self.file_list(),
            })?;
        let file = &self.files[entry.file];
        let stored = Stored::from_safetensors(entry.info.dtype).ok_or_else(|| {
            ModelError::UnsupportedDtype {
                key: key.to_string(),
                path: file.path.clone(),
                dtype: format!("{:?}", entry.info.dtype),
            }
        })?;
        let (start, end) = entry.info.data_offsets;
        // read_metadata validated that offsets lie inside the file.
        let bytes = &file.mmap[file.data_start + start..file.data_start + end];
        let count: usize = entry.info.shape.iter().product();
        if bytes.len() != count * stored.size() {
            return Err(ModelError::Safetensors {
                path: file.path.clone(),
                reason: format!(
                    "tensor `{key}` holds {} values, but its shape {:?} needs {count}",
                    bytes.len() / stored.size(),
                    entry.info.shape
                ),
            });
        }
        if let Ok(mut used) = self.used.lock() {
            used.insert(key.to_string());
        }
        Ok((entry, file, bytes, stored))
    }

    pub(crate) fn path_of(&self, key: &str) -> PathBuf {
        self.entries
            .get(key)
            .map(|e| self.files[e.file].path.clone())
            .unwrap_or_default()
    }
}

/// `entry`'s values (`bytes`, stored as `stored`) as f32, transposed back when the entry is a
/// transposed view; its range of the map is released.
fn f32_values(entry: &Entry, file: &WeightFile, bytes: &[u8], stored: Stored) -> Vec<f32> {
    let values = if entry.swap_halves {
        weight_data::to_f32(&swap_halves(bytes), stored)
    } else {
        weight_data::to_f32(bytes, stored)
    };
    let (start, end) = entry.info.data_offsets;
    release(file, file.data_start + start..file.data_start + end);
    if entry.transposed {
        // `info.shape` is `[cols, rows]` of the stored `[rows, cols]` tensor.
        let (cols, rows) = (entry.info.shape[0], entry.info.shape[1]);
        return weight_data::transpose(&values, rows, cols);
    }
    values
}

/// `bytes` with its two halves swapped (rows are whole runs of bytes, so this swaps the halves
/// of the first axis whatever the element type).
fn swap_halves(bytes: &[u8]) -> Vec<u8> {
    let half = bytes.len() / 2;
    [&bytes[half..], &bytes[..half]].concat()
}

/// A shared handle on a weight file's map, the owner of tensors that use its bytes in place.
struct Mapped(Arc<WeightFile>);

impl AsRef<[u8]> for Mapped {
    fn as_ref(&self) -> &[u8] {
        &self.0.mmap
    }
}

/// Lets the kernel drop the bytes `range` of the map from our resident set once its values
/// were copied out (the pages stay in the page cache), so loading never holds two copies.
fn release(file: &WeightFile, range: std::ops::Range<usize>) {
    // SAFETY: the map is a read-only, file-backed shared mapping, so MADV_DONTNEED discards
    // nothing: a later read of the range (by a tensor that shares a neighbouring page) faults
    // the pages back in from the file.
    #[cfg(unix)]
    let _ = unsafe {
        file.mmap.unchecked_advise_range(
            memmap2::UncheckedAdvice::DontNeed,
            range.start,
            range.len(),
        )
    };
    #[cfg(not(unix))]
    let _ = (file, range);
}

/// A tensor read by [`Weights::read_deferred`]: its data, or the conversion that makes it.
/// Which plain stored tensors [`Weights::read_deferred`] leaves to their first use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Defer {
    /// Those that must be converted into the held dtype (the CPU backend reads the others in
    /// place, in the mapped file).
    WhenConverted,
    /// All of them (a device's weights uploaded at their first use).
    Always,
}

pub(crate) enum WeightRead {
    Ready(TensorData),
    Pending(PendingRead),
}

/// A stored tensor found and checked at load ([`Weights::read_deferred`]), converted into its held
/// dtype only when [`read`](Self::read) is called: a model's first use of a weight, so that
/// loading an fp16 checkpoint into bf16 costs what mapping it costs, and a weight never used
/// is never converted. It keeps the file's map alive.
pub(crate) struct PendingRead {
    file: Arc<WeightFile>,
    /// The tensor's bytes in the map.
    range: std::ops::Range<usize>,
    stored: Stored,
    shape: Vec<usize>,
    dtype: FloatDType,
}

impl PendingRead {
    /// The tensor converted into its held dtype (one copy); its range of the map is released.
    pub(crate) fn read(&self) -> TensorData {
        let bytes = &self.file.mmap[self.range.clone()];
        let (data, shared) =
            weight_data::tensor_data(bytes, self.stored, self.shape.clone(), self.dtype, || {
                bytes::Bytes::from_owner(Mapped(self.file.clone())).slice(self.range.clone())
            });
        if !shared {
            release(&self.file, self.range.clone());
        }
        data
    }
}

/// A weights file must not be a link out of its model folder (the folder above the component's
/// folder): a stranger's checkpoint could otherwise make us read any file on the machine. The
/// one exception is the Hugging Face Hub cache, whose snapshot files are links into the
/// repository's own `blobs/` folder (`models--org--name/snapshots/REV/unet/x` ->
/// `../../../blobs/SHA`).
fn ensure_inside_model(path: &Path) -> Result<()> {
    let io = |source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    };
    let real = path.canonicalize().map_err(io)?;
    let real_parent = |p: &Path| -> PathBuf {
        match p.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => parent.to_path_buf(),
            _ => PathBuf::from("."),
        }
    };
    let component = real_parent(path).canonicalize().map_err(io)?;
    let model = real_parent(&component);
    let model_real = model.canonicalize().map_err(io)?;
    let mut allowed = vec![model_real.clone()];
    // model = .../models--org--name/snapshots/REV: its repository's blobs are allowed too.
    if let Some(repo) = model_real.parent().and_then(Path::parent) {
        let in_snapshots = model_real
            .parent()
            .and_then(Path::file_name)
            .is_some_and(|n| n == "snapshots");
        let is_repo = repo
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("models--"));
        if in_snapshots && is_repo {
            allowed.push(repo.join("blobs"));
        }
    }
    if allowed.iter().any(|root| real.starts_with(root)) {
        Ok(())
    } else {
        Err(ModelError::OutsideModel {
            path: path.to_path_buf(),
            target: real,
            model: model_real,
        })
    }
}

/// What a path that is no regular file is, in words.
fn file_kind(meta: &std::fs::Metadata) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        let kind = meta.file_type();
        if kind.is_fifo() {
            return "a FIFO (named pipe)";
        }
        if kind.is_char_device() || kind.is_block_device() {
            return "a device";
        }
        if kind.is_socket() {
            return "a socket";
        }
    }
    if meta.is_dir() {
        "a folder"
    } else {
        "not a regular file"
    }
}
