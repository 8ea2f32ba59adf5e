//! Burn's `OperationIr` to StableHLO, as MLIR text: the one lowering that
//! eager mode (one op per function, [`lower_op`]) and compiled mode (a traced
//! sequence of ops in one function) share. It sits between the clients
//! (`eager`) and the PJRT runtime (`pjrt`), and knows nothing about either.
//!
//! A [`Lowerer`] builds one `func.func @main`: every tensor it has not seen is
//! a function argument, every scalar of an op (the `2.0` of `x * 2.0`, a fill
//! value, clamp bounds, an attention scale) is a rank-0 argument too and never
//! a literal, so one compiled executable serves every scalar value. Literals
//! appear only for values fixed by the op's structure (0 and 1, -inf, shape
//! derived counts and indices). Each op's outputs are bound to SSA values by
//! [`TensorId`], so ops lowered one after another chain inside the function;
//! [`Lowerer::finish`] returns the module text, its arguments in order and its
//! results.
//!
//! Ops are written in MLIR's generic form (`"stablehlo.add"(%a, %b) : ...`),
//! which every StableHLO version parses the same way, except convolution,
//! which uses its pretty form. Ops not lowered yet fail with
//! [`LowerError::Unsupported`] naming the op.
//!
//! This file holds the types and the dispatch; `emit` the StableHLO helpers;
//! one file per family of Burn's ops, as burn-router's `ops/` cuts them:
//! `base`, `numeric`, `float`, `int`, `bool`, `module`.

mod base;
mod bool;
mod emit;
mod float;
mod int;
mod module;
mod numeric;

use std::collections::HashMap;
use std::fmt::Write as _;

use burn_backend::DType;
use burn_ir::{OperationIr, ScalarIr, TensorId, TensorIr};

use crate::pjrt::ElementType;

/// Why an op could not be lowered.
#[derive(Debug, Clone, thiserror::Error)]
pub enum LowerError {
    /// The op (or this form of it) has no lowering yet.
    #[error("op {op} is not lowered to StableHLO yet{detail}: run it on the cpu device, or add its lowering in backend-tpu/src/lowering/")]
    Unsupported { op: String, detail: String },
    /// A Burn dtype with no PJRT element type.
    #[error("op {op}: dtype {dtype:?} has no PJRT element type")]
    DType { op: String, dtype: DType },
    /// An inconsistency between the IR and the lowering (a bug here).
    #[error("op {op}: {message}")]
    Internal { op: String, message: String },
}

pub type Result<T> = std::result::Result<T, LowerError>;

/// The PJRT element type of a Burn dtype.
pub fn element_type(dtype: DType) -> Option<ElementType> {
    Some(match dtype {
        DType::F64 => ElementType::F64,
        DType::F32 | DType::Flex32 => ElementType::F32,
        DType::F16 => ElementType::F16,
        DType::BF16 => ElementType::BF16,
        DType::I64 => ElementType::S64,
        DType::I32 => ElementType::S32,
        DType::I16 => ElementType::S16,
        DType::I8 => ElementType::S8,
        DType::U64 => ElementType::U64,
        DType::U32 => ElementType::U32,
        DType::U16 => ElementType::U16,
        DType::U8 => ElementType::U8,
        DType::Bool(burn_backend::BoolStore::Native | burn_backend::BoolStore::U8) => {
            ElementType::Pred
        }
        _ => return None,
    })
}

fn is_float(e: ElementType) -> bool {
    matches!(
        e,
        ElementType::F16 | ElementType::BF16 | ElementType::F32 | ElementType::F64
    )
}

fn is_unsigned(e: ElementType) -> bool {
    matches!(
        e,
        ElementType::U8
            | ElementType::U16
            | ElementType::U32
            | ElementType::U64
            | ElementType::Pred
    )
}

/// A tensor type: dimensions and element type.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TensorType {
    pub dims: Vec<usize>,
    pub elem: ElementType,
}

impl TensorType {
    pub fn new(dims: impl Into<Vec<usize>>, elem: ElementType) -> Self {
        Self {
            dims: dims.into(),
            elem,
        }
    }

    /// `tensor<2x3xf32>`, `tensor<f32>` for rank 0.
    pub fn mlir(&self) -> String {
        let mut s = String::from("tensor<");
        for d in &self.dims {
            let _ = write!(s, "{d}x");
        }
        s.push_str(self.elem.mlir_name());
        s.push('>');
        s
    }

    fn rank(&self) -> usize {
        self.dims.len()
    }

    fn with_elem(&self, elem: ElementType) -> Self {
        Self::new(self.dims.clone(), elem)
    }

    fn with_dims(&self, dims: impl Into<Vec<usize>>) -> Self {
        Self::new(dims, self.elem)
    }
}

/// What the caller passes for one function argument.
#[derive(Clone, Debug, PartialEq)]
pub enum Argument {
    /// The buffer of a tensor.
    Tensor(TensorId),
    /// A scalar of the op, as a rank-0 buffer of the argument's type.
    Scalar(ScalarIr),
    /// The state of the random bit generator: a `ui64[2]` buffer the caller
    /// draws from its seeded generator.
    RngState,
    /// The buffer of a tensor with its dimensions permuted (dimension `i` of
    /// the argument is dimension `permutation[i]` of the tensor): a
    /// convolution kernel in the layout the backend's convolution wants
    /// ([`Lowerer::with_kernels_last`]), which the caller prepares once.
    Permuted {
        id: TensorId,
        permutation: Vec<usize>,
    },
}

/// One lowered function: a module with `func.func @main`.
#[derive(Clone, Debug)]
pub struct LoweredFunction {
    /// The MLIR module text; the same for every op of the same structure,
    /// shapes and dtypes, whatever its scalars: use it as the cache key.
    pub module: String,
    /// The arguments, in order.
    pub arguments: Vec<(Argument, TensorType)>,
    /// The results, in order.
    pub results: Vec<(TensorId, TensorType)>,
    /// Attention ops lowered to a hub kernel ([`Lowerer::with_kernels`]).
    pub kernel_calls: usize,
}

impl LoweredFunction {
    /// The module for GSPMD over `partitions` devices: `mhlo.num_partitions` set, and each
    /// argument and result of `@main` carrying its `mhlo.sharding` (one per argument, one per
    /// result, in XLA's HloSharding syntax such as `{replicated}` or `{devices=[1,2]0,1}`).
    pub fn partitioned(
        &self,
        partitions: usize,
        argument_shardings: &[String],
        result_shardings: &[String],
    ) -> String {
        let params = self
            .arguments
            .iter()
            .zip(argument_shardings)
            .enumerate()
            .map(|(i, ((_, ty), sharding))| {
                format!("%arg{i}: {} {{mhlo.sharding = \"{sharding}\"}}", ty.mlir())
            })
            .collect::<Vec<_>>()
            .join(", ");
        let results = self
            .results
            .iter()
            .zip(result_shardings)
            .map(|((_, ty), sharding)| format!("{} {{mhlo.sharding = \"{sharding}\"}}", ty.mlir()))
            .collect::<Vec<_>>()
            .join(", ");
        // The first two lines are the module and `@main` headers `finish` wrote.
        let mut lines = self.module.splitn(3, '\n');
        let (_, _, body) = (lines.next(), lines.next(), lines.next().unwrap_or(""));
        format!(
            "module @oxidiff attributes {{mhlo.num_partitions = {partitions} : i32, mhlo.num_replicas = 1 : i32}} {{\n  func.func public @main({params}) -> ({results}) {{\n{body}"
        )
    }
}

/// An SSA value of the function being built.
#[derive(Clone, Debug)]
struct Value {
    name: String,
    ty: TensorType,
}

/// Builds one StableHLO function from a sequence of ops.
#[derive(Default)]
pub struct Lowerer {
    body: String,
    counter: usize,
    values: HashMap<TensorId, Value>,
    arguments: Vec<(Argument, TensorType)>,
    /// Name of the op being lowered, for errors.
    op: String,
    /// Whether convolution kernels that are arguments come in as
    /// [`Argument::Permuted`], spatial dimensions first.
    kernels_last: bool,
    /// The [`Argument::Permuted`] values declared so far, by tensor.
    permuted: HashMap<TensorId, Value>,
    /// Hub kernels attention may be lowered to ([`Lowerer::with_kernels`]).
    kernels: Option<std::sync::Arc<crate::kernels::AttentionKernels>>,
    /// The kernels spliced in: each artifact's functions once (by file), and its entry.
    spliced: Vec<(std::path::PathBuf, String, String)>,
    /// Attention ops lowered to a hub kernel.
    kernel_calls: usize,
    /// The mesh of a partitioned program whose kernel calls run per device
    /// ([`Lowerer::with_kernels_over`]).
    kernel_mesh: Option<crate::spmd::Mesh>,
    /// The host kernels' custom-call targets the ops may call ([`Lowerer::with_host_kernels`]).
    host_targets: Vec<&'static str>,
}

/// Lowers one op into a function of its own (eager mode).
pub fn lower_op(op: &OperationIr) -> Result<LoweredFunction> {
    let mut lowerer = Lowerer::new();
    lowerer.lower(op)?;
    let outputs: Vec<TensorId> = op.outputs().map(|t| t.id).collect();
    lowerer.finish(&outputs)
}

/// A short name of an op, like `Float(Exp)` or `Module(Conv2d)`.
pub fn op_name(op: &OperationIr) -> String {
    let text = format!("{op:?}");
    let Some(open) = text.find('(') else {
        return text;
    };
    let outer = &text[..open];
    let mut rest = &text[open + 1..];
    if matches!(outer, "NumericFloat" | "NumericInt" | "Float") {
        if let Some(comma) = rest.find(", ") {
            rest = &rest[comma + 2..];
        }
    }
    let end = rest.find(['(', ' ', '{', ')']).unwrap_or(rest.len());
    format!("{outer}({})", &rest[..end])
}

impl Lowerer {
    pub fn new() -> Self {
        Self::default()
    }

    /// A lowerer that takes each convolution kernel that is a function
    /// argument (a weight, not a value computed in the function) as
    /// [`Argument::Permuted`] in the layout `[spatial.., in, out]` instead of
    /// Burn's `[out, in, spatial..]`. XLA's CPU convolutions want that layout
    /// and otherwise transpose every kernel on every call; a caller that runs
    /// one program many times, like compiled mode, prepares the permuted
    /// kernels once.
    pub fn with_kernels_last() -> Self {
        Self {
            kernels_last: true,
            ..Self::default()
        }
    }

    /// This lowerer with the ops that the host kernels `targets` compute lowered to custom
    /// calls of them ([`crate::host_kernels`]; for XLA's CPU plugin, the targets it
    /// registered): f32 2-D convolutions ([`CONV2D_F32`](crate::host_kernels::CONV2D_F32)),
    /// f32 attention ([`ATTENTION_F32`](crate::host_kernels::ATTENTION_F32)) and f32 products
    /// with a 2-D right side ([`MATMUL_F32`](crate::host_kernels::MATMUL_F32)). Such a
    /// convolution takes its kernel in Burn's layout, never [`Argument::Permuted`].
    pub fn with_host_kernels(mut self, targets: impl IntoIterator<Item = &'static str>) -> Self {
        self.host_targets = targets.into_iter().collect();
        self
    }

    /// Whether ops may call the host kernel `target`.
    fn host_kernel(&self, target: &str) -> bool {
        self.host_targets.contains(&target)
    }

    /// This lowerer with attention lowered to the hub's kernels where one matches (the
    /// kernel's functions appended to the module, a `func.call` in place of the attention),
    /// the plain lowering elsewhere.
    pub fn with_kernels(
        mut self,
        kernels: std::sync::Arc<crate::kernels::AttentionKernels>,
    ) -> Self {
        self.kernels = Some(kernels);
        self
    }

    /// [`with_kernels`](Self::with_kernels) for a program partitioned over `mesh` (GSPMD),
    /// whose attention runs with the batch split over the data-parallel axis and the heads over
    /// the tensor-parallel axis (as the models' plans split q, k and v): each kernel call runs
    /// on every device's own rows and heads, inside a manual-sharding region (XLA's
    /// `SPMDFullToShardShape` and `SPMDShardToFullShape`, as JAX lowers `shard_map`), so the
    /// kernel is the hub's for the per-device shape. Attention whose batch or heads the mesh
    /// does not divide keeps the plain lowering.
    pub fn with_kernels_over(
        mut self,
        kernels: std::sync::Arc<crate::kernels::AttentionKernels>,
        mesh: crate::spmd::Mesh,
    ) -> Self {
        self.kernels = Some(kernels);
        self.kernel_mesh = (mesh.partitions() > 1).then_some(mesh);
        self
    }

    /// Lowers `op`, binding its outputs.
    pub fn lower(&mut self, op: &OperationIr) -> Result<()> {
        self.op = op_name(op);
        match op {
            OperationIr::BaseFloat(base)
            | OperationIr::BaseInt(base)
            | OperationIr::BaseBool(base) => self.lower_base(base),
            OperationIr::NumericFloat(_, numeric) | OperationIr::NumericInt(_, numeric) => {
                self.lower_numeric(numeric)
            }
            OperationIr::Float(_, float) => self.lower_float(float),
            OperationIr::Int(int) => self.lower_int(int),
            OperationIr::Bool(op) => self.lower_bool(op),
            OperationIr::Module(module) => self.lower_module(module),
            _ => self.unsupported(""),
        }
    }

    /// Makes `tensor` the next function argument unless it already has a
    /// value (compiled mode declares its inputs first, in order).
    pub fn declare_input(&mut self, tensor: &TensorIr) -> Result<()> {
        self.input(tensor).map(|_| ())
    }

    /// Whether `id` has a value in the function so far.
    pub fn has_value(&self, id: TensorId) -> bool {
        self.values.contains_key(&id)
    }

    /// The module text for a function returning `outputs`.
    pub fn finish(self, outputs: &[TensorId]) -> Result<LoweredFunction> {
        let mut results = Vec::with_capacity(outputs.len());
        let mut names = Vec::with_capacity(outputs.len());
        for id in outputs {
            let value = self.values.get(id).ok_or_else(|| LowerError::Internal {
                op: self.op.clone(),
                message: format!("output {id} was never computed"),
            })?;
            names.push(value.name.clone());
            results.push((*id, value.ty.clone()));
        }
        let params = self
            .arguments
            .iter()
            .enumerate()
            .map(|(i, (_, ty))| format!("%arg{i}: {}", ty.mlir()))
            .collect::<Vec<_>>()
            .join(", ");
        let result_types = results
            .iter()
            .map(|(_, ty)| ty.mlir())
            .collect::<Vec<_>>()
            .join(", ");
        let mut module = String::with_capacity(self.body.len() + 256);
        let _ = writeln!(
            module,
            "module @oxidiff attributes {{mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 1 : i32}} {{"
        );
        let _ = writeln!(
            module,
            "  func.func public @main({params}) -> ({result_types}) {{"
        );
        module.push_str(&self.body);
        let _ = writeln!(
            module,
            "    \"func.return\"({}) : ({result_types}) -> ()",
            names.join(", ")
        );
        module.push_str("  }\n");
        for (_, _, functions) in &self.spliced {
            module.push_str(functions);
        }
        module.push_str("}\n");
        Ok(LoweredFunction {
            module,
            arguments: self.arguments,
            results,
            kernel_calls: self.kernel_calls,
        })
    }

    // ---- errors --------------------------------------------------------

    fn unsupported<T>(&self, detail: &str) -> Result<T> {
        Err(LowerError::Unsupported {
            op: self.op.clone(),
            detail: if detail.is_empty() {
                String::new()
            } else {
                format!(" ({detail})")
            },
        })
    }

    fn internal<T>(&self, message: impl Into<String>) -> Result<T> {
        Err(LowerError::Internal {
            op: self.op.clone(),
            message: message.into(),
        })
    }

    fn elem(&self, dtype: DType) -> Result<ElementType> {
        element_type(dtype).ok_or_else(|| LowerError::DType {
            op: self.op.clone(),
            dtype,
        })
    }

    fn ty(&self, tensor: &TensorIr) -> Result<TensorType> {
        Ok(TensorType::new(
            tensor.shape.to_vec(),
            self.elem(tensor.dtype)?,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn_backend::Shape;
    use burn_ir::{
        BinaryOpIr, FloatOperationIr, NumericOperationIr, ScalarOpIr, TensorStatus, UnaryOpIr,
    };

    fn tensor(id: u64, dims: &[usize]) -> TensorIr {
        TensorIr {
            id: TensorId::new(id),
            shape: Shape::from(dims.to_vec()),
            status: TensorStatus::ReadOnly,
            dtype: DType::F32,
        }
    }

    #[test]
    fn scalar_ops_take_the_scalar_as_an_argument_not_a_literal() {
        let op = |value: f64| {
            OperationIr::NumericFloat(
                DType::F32,
                NumericOperationIr::MulScalar(ScalarOpIr {
                    lhs: tensor(1, &[2, 3]),
                    rhs: ScalarIr::Float(value),
                    out: tensor(2, &[2, 3]),
                }),
            )
        };
        let a = lower_op(&op(2.0)).unwrap_or_else(|e| panic!("{e}"));
        let b = lower_op(&op(-7.5)).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            a.module, b.module,
            "the module must not depend on the scalar"
        );
        assert_eq!(a.arguments.len(), 2);
        assert_eq!(a.arguments[1].0, Argument::Scalar(ScalarIr::Float(2.0)));
        assert!(a
            .module
            .contains("func.func public @main(%arg0: tensor<2x3xf32>, %arg1: tensor<f32>)"));
        assert!(a.module.contains("\"stablehlo.multiply\""), "{}", a.module);
    }

    #[test]
    fn op_names_are_short() {
        let op = OperationIr::Float(
            DType::F32,
            FloatOperationIr::Exp(UnaryOpIr {
                input: tensor(1, &[2]),
                out: tensor(2, &[2]),
            }),
        );
        assert_eq!(op_name(&op), "Float(Exp)");
    }

    #[test]
    fn two_ops_chain_in_one_function() {
        let mut lowerer = Lowerer::new();
        let exp = OperationIr::Float(
            DType::F32,
            FloatOperationIr::Exp(UnaryOpIr {
                input: tensor(1, &[4]),
                out: tensor(2, &[4]),
            }),
        );
        let add = OperationIr::NumericFloat(
            DType::F32,
            NumericOperationIr::Add(BinaryOpIr {
                lhs: tensor(2, &[4]),
                rhs: tensor(1, &[4]),
                out: tensor(3, &[4]),
            }),
        );
        lowerer.lower(&exp).unwrap_or_else(|e| panic!("{e}"));
        lowerer.lower(&add).unwrap_or_else(|e| panic!("{e}"));
        let f = lowerer
            .finish(&[TensorId::new(3)])
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(f.arguments.len(), 1, "{}", f.module);
        assert_eq!(f.results.len(), 1);
    }
}
