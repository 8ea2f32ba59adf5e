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

use std::collections::HashMap;
use std::fmt::Write as _;

use burn_backend::tensor::IndexingUpdateOp;
use burn_backend::{DType, Distribution, Slice};
use burn_ir::{
    AttentionOpIr, BaseOperationIr, BinaryOpIr, BoolOperationIr, FloatOperationIr, IntOperationIr,
    InterpolateModeIr, ModuleOperationIr, NumericOperationIr, OperationIr, ReduceDimOpIr, ScalarIr,
    ScalarOpIr, TensorId, TensorIr, UnaryOpIr,
};

use crate::pjrt::ElementType;

/// Why an op could not be lowered.
#[derive(Debug, Clone, thiserror::Error)]
pub enum LowerError {
    /// The op (or this form of it) has no lowering yet.
    #[error("op {op} is not lowered to StableHLO yet{detail}: run it on the cpu device, or add its lowering in backend-tpu/src/lowering.rs")]
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
    /// and otherwise transpose every kernel on every call (about 2 GB for the
    /// SD 1.5 UNet, a quarter of its step time on one core, and as much
    /// scratch memory); a caller that runs one program many times, like
    /// compiled mode, prepares the permuted kernels once.
    pub fn with_kernels_last() -> Self {
        Self {
            kernels_last: true,
            ..Self::default()
        }
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
        module.push_str("  }\n}\n");
        Ok(LoweredFunction {
            module,
            arguments: self.arguments,
            results,
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

    // ---- values ----------------------------------------------------------

    fn fresh(&mut self) -> String {
        self.counter += 1;
        format!("%v{}", self.counter)
    }

    /// The value of an input tensor: computed earlier in this function, or a
    /// new argument.
    fn input(&mut self, tensor: &TensorIr) -> Result<Value> {
        if let Some(value) = self.values.get(&tensor.id) {
            return Ok(value.clone());
        }
        let ty = self.ty(tensor)?;
        let value = Value {
            name: format!("%arg{}", self.arguments.len()),
            ty: ty.clone(),
        };
        self.arguments.push((Argument::Tensor(tensor.id), ty));
        self.values.insert(tensor.id, value.clone());
        Ok(value)
    }

    /// `tensor` as an [`Argument::Permuted`] by `permutation` (declared once
    /// per tensor).
    fn permuted_input(&mut self, tensor: &TensorIr, permutation: &[usize]) -> Result<Value> {
        if let Some(value) = self.permuted.get(&tensor.id) {
            return Ok(value.clone());
        }
        let ty = self.ty(tensor)?;
        let ty = ty.with_dims(permutation.iter().map(|&p| ty.dims[p]).collect::<Vec<_>>());
        let value = Value {
            name: format!("%arg{}", self.arguments.len()),
            ty: ty.clone(),
        };
        self.arguments.push((
            Argument::Permuted {
                id: tensor.id,
                permutation: permutation.to_vec(),
            },
            ty,
        ));
        self.permuted.insert(tensor.id, value.clone());
        Ok(value)
    }

    /// A scalar of the op as a rank-0 argument of element type `elem`.
    fn scalar(&mut self, scalar: ScalarIr, elem: ElementType) -> Value {
        let ty = TensorType::new(Vec::new(), elem);
        let value = Value {
            name: format!("%arg{}", self.arguments.len()),
            ty: ty.clone(),
        };
        self.arguments.push((Argument::Scalar(scalar), ty));
        value
    }

    /// Binds `out` to `value`, converting a mismatch in the element type and
    /// reshaping one in dimensions with the same element count.
    fn bind(&mut self, out: &TensorIr, value: Value) -> Result<()> {
        let ty = self.ty(out)?;
        let mut value = value;
        if value.ty.elem != ty.elem {
            value = self.convert(&value, ty.elem);
        }
        if value.ty.dims != ty.dims {
            let have: usize = value.ty.dims.iter().product();
            let want: usize = ty.dims.iter().product();
            if have != want {
                return self.internal(format!(
                    "computed {:?} for output {:?}",
                    value.ty.dims, ty.dims
                ));
            }
            value = self.reshape(&value, &ty.dims);
        }
        self.values.insert(out.id, value);
        Ok(())
    }

    // ---- emission --------------------------------------------------------

    /// `%r = "name"(operands) attrs : (types) -> ty`.
    fn emit(&mut self, name: &str, operands: &[&Value], attrs: &str, ty: TensorType) -> Value {
        let result = self.fresh();
        let names = operands
            .iter()
            .map(|v| v.name.as_str())
            .collect::<Vec<_>>()
            .join(", ");
        let types = operands
            .iter()
            .map(|v| v.ty.mlir())
            .collect::<Vec<_>>()
            .join(", ");
        let attrs = if attrs.is_empty() {
            String::new()
        } else {
            format!(" {{{attrs}}}")
        };
        let _ = writeln!(
            self.body,
            "    {result} = \"{name}\"({names}){attrs} : ({types}) -> {}",
            ty.mlir()
        );
        Value { name: result, ty }
    }

    /// A rank-0 constant fixed by the op's structure.
    fn constant(&mut self, value: f64, elem: ElementType) -> Value {
        let ty = TensorType::new(Vec::new(), elem);
        let literal = literal(value, elem);
        self.emit(
            "stablehlo.constant",
            &[],
            &format!("value = dense<{literal}> : {}", ty.mlir()),
            ty,
        )
    }

    /// A constant of `dims` filled with `value`.
    fn filled(&mut self, value: f64, ty: &TensorType) -> Value {
        let scalar = self.constant(value, ty.elem);
        self.broadcast(&scalar, &ty.dims)
    }

    fn unary(&mut self, name: &str, x: &Value) -> Value {
        let ty = x.ty.clone();
        self.emit(name, &[x], "", ty)
    }

    fn binary(&mut self, name: &str, a: &Value, b: &Value) -> Value {
        let ty = a.ty.clone();
        self.emit(name, &[a, b], "", ty)
    }

    /// Numpy broadcasting (trailing dimensions aligned) to `dims`.
    fn broadcast(&mut self, x: &Value, dims: &[usize]) -> Value {
        if x.ty.dims == dims {
            return x.clone();
        }
        let offset = dims.len().saturating_sub(x.ty.rank());
        let mapping = (offset..dims.len()).collect::<Vec<_>>();
        let ty = x.ty.with_dims(dims);
        self.emit(
            "stablehlo.broadcast_in_dim",
            &[x],
            &format!("broadcast_dimensions = {}", i64_array(&mapping)),
            ty,
        )
    }

    /// Broadcast with an explicit mapping of `x`'s dimensions.
    fn broadcast_in_dim(&mut self, x: &Value, dims: &[usize], mapping: &[usize]) -> Value {
        let ty = x.ty.with_dims(dims);
        self.emit(
            "stablehlo.broadcast_in_dim",
            &[x],
            &format!("broadcast_dimensions = {}", i64_array(mapping)),
            ty,
        )
    }

    fn reshape(&mut self, x: &Value, dims: &[usize]) -> Value {
        if x.ty.dims == dims {
            return x.clone();
        }
        let ty = x.ty.with_dims(dims);
        self.emit("stablehlo.reshape", &[x], "", ty)
    }

    fn transpose(&mut self, x: &Value, permutation: &[usize]) -> Value {
        if permutation.iter().enumerate().all(|(i, &p)| i == p) {
            return x.clone();
        }
        let dims = permutation
            .iter()
            .map(|&p| x.ty.dims[p])
            .collect::<Vec<_>>();
        let ty = x.ty.with_dims(dims);
        self.emit(
            "stablehlo.transpose",
            &[x],
            &format!("permutation = {}", i64_array(permutation)),
            ty,
        )
    }

    fn convert(&mut self, x: &Value, elem: ElementType) -> Value {
        if x.ty.elem == elem {
            return x.clone();
        }
        if elem == ElementType::Pred {
            // x != 0, the cast every frontend means.
            let zero = self.filled(0.0, &x.ty);
            return self.compare("NE", x, &zero);
        }
        let ty = x.ty.with_elem(elem);
        self.emit("stablehlo.convert", &[x], "", ty)
    }

    fn compare(&mut self, direction: &str, a: &Value, b: &Value) -> Value {
        let ty = a.ty.with_elem(ElementType::Pred);
        self.emit(
            "stablehlo.compare",
            &[a, b],
            &format!("comparison_direction = #stablehlo<comparison_direction {direction}>"),
            ty,
        )
    }

    fn select(&mut self, pred: &Value, on_true: &Value, on_false: &Value) -> Value {
        let ty = on_true.ty.clone();
        self.emit("stablehlo.select", &[pred, on_true, on_false], "", ty)
    }

    fn iota(&mut self, dims: &[usize], dimension: usize, elem: ElementType) -> Value {
        self.emit(
            "stablehlo.iota",
            &[],
            &format!("iota_dimension = {dimension} : i64"),
            TensorType::new(dims, elem),
        )
    }

    fn concatenate(&mut self, values: &[&Value], dimension: usize) -> Result<Value> {
        let Some(first) = values.first() else {
            return self.internal("concatenate of nothing");
        };
        if values.len() == 1 {
            return Ok((*first).clone());
        }
        let mut dims = first.ty.dims.clone();
        dims[dimension] = values.iter().map(|v| v.ty.dims[dimension]).sum();
        let ty = first.ty.with_dims(dims);
        Ok(self.emit(
            "stablehlo.concatenate",
            values,
            &format!("dimension = {dimension} : i64"),
            ty,
        ))
    }

    fn slice(&mut self, x: &Value, start: &[usize], limit: &[usize], strides: &[usize]) -> Value {
        let dims = start
            .iter()
            .zip(limit)
            .zip(strides)
            .map(|((&s, &l), &st)| if l > s { (l - s).div_ceil(st) } else { 0 })
            .collect::<Vec<_>>();
        let ty = x.ty.with_dims(dims);
        self.emit(
            "stablehlo.slice",
            &[x],
            &format!(
                "start_indices = {}, limit_indices = {}, strides = {}",
                i64_array(start),
                i64_array(limit),
                i64_array(strides)
            ),
            ty,
        )
    }

    /// `reduce` over `dimensions` with the binary `combiner` and `init`.
    fn reduce(&mut self, x: &Value, dimensions: &[usize], combiner: &str, init: f64) -> Value {
        let init = self.constant(init, x.ty.elem);
        let dims =
            x.ty.dims
                .iter()
                .enumerate()
                .filter(|(i, _)| !dimensions.contains(i))
                .map(|(_, &d)| d)
                .collect::<Vec<_>>();
        let ty = x.ty.with_dims(dims);
        let scalar = TensorType::new(Vec::new(), x.ty.elem).mlir();
        let result = self.fresh();
        let a = self.fresh();
        let b = self.fresh();
        let c = self.fresh();
        let _ = writeln!(
            self.body,
            "    {result} = \"stablehlo.reduce\"({}, {}) ({{\n    ^bb0({a}: {scalar}, {b}: {scalar}):\n      {c} = \"{combiner}\"({a}, {b}) : ({scalar}, {scalar}) -> {scalar}\n      \"stablehlo.return\"({c}) : ({scalar}) -> ()\n    }}) {{dimensions = {}}} : ({}, {scalar}) -> {}",
            x.name,
            init.name,
            i64_array(dimensions),
            x.ty.mlir(),
            ty.mlir()
        );
        Value { name: result, ty }
    }

    /// `dot_general` with the given batch and contracting dimensions.
    fn dot_general(
        &mut self,
        lhs: &Value,
        rhs: &Value,
        batch: (&[usize], &[usize]),
        contracting: (&[usize], &[usize]),
        dims: Vec<usize>,
    ) -> Value {
        let mut numbers = Vec::new();
        if !batch.0.is_empty() {
            numbers.push(format!("lhs_batching_dimensions = {}", list(batch.0)));
            numbers.push(format!("rhs_batching_dimensions = {}", list(batch.1)));
        }
        numbers.push(format!(
            "lhs_contracting_dimensions = {}",
            list(contracting.0)
        ));
        numbers.push(format!(
            "rhs_contracting_dimensions = {}",
            list(contracting.1)
        ));
        let mut attrs = format!(
            "dot_dimension_numbers = #stablehlo.dot<{}>",
            numbers.join(", ")
        );
        if lhs.ty.elem == ElementType::F32 || lhs.ty.elem == ElementType::F64 {
            // TPUs default to bf16 passes for f32 dots; ask for full precision.
            attrs.push_str(", precision_config = [#stablehlo<precision HIGHEST>, #stablehlo<precision HIGHEST>]");
        }
        let ty = lhs.ty.with_dims(dims);
        self.emit("stablehlo.dot_general", &[lhs, rhs], &attrs, ty)
    }

    /// `gather` with explicit dimension numbers.
    #[allow(clippy::too_many_arguments)]
    fn gather(
        &mut self,
        operand: &Value,
        indices: &Value,
        offset_dims: &[usize],
        collapsed: &[usize],
        start_index_map: &[usize],
        index_vector_dim: usize,
        slice_sizes: &[usize],
        dims: Vec<usize>,
    ) -> Value {
        let mut numbers = Vec::new();
        if !offset_dims.is_empty() {
            numbers.push(format!("offset_dims = {}", list(offset_dims)));
        }
        if !collapsed.is_empty() {
            numbers.push(format!("collapsed_slice_dims = {}", list(collapsed)));
        }
        numbers.push(format!("start_index_map = {}", list(start_index_map)));
        numbers.push(format!("index_vector_dim = {index_vector_dim}"));
        let attrs = format!(
            "dimension_numbers = #stablehlo.gather<{}>, indices_are_sorted = false, slice_sizes = {}",
            numbers.join(", "),
            i64_array(slice_sizes)
        );
        let ty = operand.ty.with_dims(dims);
        self.emit("stablehlo.gather", &[operand, indices], &attrs, ty)
    }

    /// `x[..., indices, ...]` along `dim` with a rank-1 index tensor.
    fn take(&mut self, x: &Value, dim: usize, indices: &Value) -> Value {
        let rank = x.ty.rank();
        let count = indices.ty.dims.first().copied().unwrap_or(1);
        let offset_dims = (0..rank).filter(|&d| d != dim).collect::<Vec<_>>();
        let mut slice_sizes = x.ty.dims.clone();
        slice_sizes[dim] = 1;
        let mut dims = x.ty.dims.clone();
        dims[dim] = count;
        self.gather(
            x,
            indices,
            &offset_dims,
            &[dim],
            &[dim],
            1,
            &slice_sizes,
            dims,
        )
    }

    // ---- op families -----------------------------------------------------

    fn lower_base(&mut self, op: &BaseOperationIr) -> Result<()> {
        match op {
            BaseOperationIr::Reshape(desc) => {
                let x = self.input(&desc.input)?;
                let y = self.reshape(&x, &desc.out.shape);
                self.bind(&desc.out, y)
            }
            BaseOperationIr::SwapDims(desc) => {
                let x = self.input(&desc.input)?;
                let mut permutation = (0..x.ty.rank()).collect::<Vec<_>>();
                permutation.swap(desc.dim1, desc.dim2);
                let y = self.transpose(&x, &permutation);
                self.bind(&desc.out, y)
            }
            BaseOperationIr::Permute(desc) => {
                let x = self.input(&desc.input)?;
                let y = self.transpose(&x, &desc.axes);
                self.bind(&desc.out, y)
            }
            BaseOperationIr::Flip(desc) => {
                let x = self.input(&desc.input)?;
                let ty = x.ty.clone();
                let y = self.emit(
                    "stablehlo.reverse",
                    &[&x],
                    &format!("dimensions = {}", i64_array(&desc.axes)),
                    ty,
                );
                self.bind(&desc.out, y)
            }
            BaseOperationIr::Expand(desc) => {
                let x = self.input(&desc.input)?;
                let y = self.broadcast(&x, &desc.out.shape);
                self.bind(&desc.out, y)
            }
            BaseOperationIr::Slice(desc) => {
                let x = self.input(&desc.tensor)?;
                let (start, limit, strides) = self.slice_bounds(&x.ty.dims, &desc.ranges)?;
                let y = self.slice(&x, &start, &limit, &strides);
                self.bind(&desc.out, y)
            }
            BaseOperationIr::SliceAssign(desc) => {
                let x = self.input(&desc.tensor)?;
                let value = self.input(&desc.value)?;
                let (start, _, strides) = self.slice_bounds(&x.ty.dims, &desc.ranges)?;
                if strides.iter().any(|&s| s != 1) {
                    return self.unsupported("slice_assign with a step");
                }
                let indices = start
                    .iter()
                    .map(|&s| self.constant(s as f64, ElementType::S64))
                    .collect::<Vec<_>>();
                let mut operands = vec![&x, &value];
                operands.extend(indices.iter());
                let ty = x.ty.clone();
                let y = self.emit("stablehlo.dynamic_update_slice", &operands, "", ty);
                self.bind(&desc.out, y)
            }
            BaseOperationIr::Gather(desc) => {
                let x = self.input(&desc.tensor)?;
                let indices = self.input(&desc.indices)?;
                let y = self.gather_along(&x, desc.dim, &indices)?;
                self.bind(&desc.out, y)
            }
            BaseOperationIr::Select(desc) => {
                let x = self.input(&desc.tensor)?;
                let indices = self.input(&desc.indices)?;
                let indices = self.convert(&indices, ElementType::S64);
                let y = self.take(&x, desc.dim, &indices);
                self.bind(&desc.out, y)
            }
            BaseOperationIr::Scatter(desc) => {
                let x = self.input(&desc.tensor)?;
                let indices = self.input(&desc.indices)?;
                let values = self.input(&desc.value)?;
                let values = self.convert(&values, x.ty.elem);
                let full = self.full_indices(desc.dim, &indices)?;
                let rank = x.ty.rank();
                let all = (0..rank).collect::<Vec<_>>();
                let numbers = ScatterNumbers {
                    update_window_dims: &[],
                    inserted_window_dims: &all,
                    scatter_dims_to_operand_dims: &all,
                    index_vector_dim: rank,
                };
                let y = self.scatter(&x, &full, &values, &numbers, desc.update);
                self.bind(&desc.out, y)
            }
            BaseOperationIr::SelectAssign(desc) => {
                let x = self.input(&desc.tensor)?;
                let indices = self.input(&desc.indices)?;
                let indices = self.convert(&indices, ElementType::S64);
                let count = indices.ty.dims.first().copied().unwrap_or(1);
                let indices = self.reshape(&indices, &[count, 1]);
                let values = self.input(&desc.value)?;
                let values = self.convert(&values, x.ty.elem);
                let window = (0..x.ty.rank())
                    .filter(|&d| d != desc.dim)
                    .collect::<Vec<_>>();
                let numbers = ScatterNumbers {
                    update_window_dims: &window,
                    inserted_window_dims: &[desc.dim],
                    scatter_dims_to_operand_dims: &[desc.dim],
                    index_vector_dim: 1,
                };
                let y = self.scatter(&x, &indices, &values, &numbers, desc.update);
                self.bind(&desc.out, y)
            }
            BaseOperationIr::MaskWhere(desc) => {
                let dims = desc.out.shape.to_vec();
                let x = self.input(&desc.tensor)?;
                let mask = self.input(&desc.mask)?;
                let value = self.input(&desc.value)?;
                let x = self.broadcast(&x, &dims);
                let mask = self.broadcast(&mask, &dims);
                let value = self.broadcast(&value, &dims);
                let value = self.convert(&value, x.ty.elem);
                let y = self.select(&mask, &value, &x);
                self.bind(&desc.out, y)
            }
            BaseOperationIr::MaskFill(desc) => {
                let dims = desc.out.shape.to_vec();
                let x = self.input(&desc.tensor)?;
                let mask = self.input(&desc.mask)?;
                let x = self.broadcast(&x, &dims);
                let mask = self.broadcast(&mask, &dims);
                let value = self.scalar(desc.value, x.ty.elem);
                let value = self.broadcast(&value, &dims);
                let y = self.select(&mask, &value, &x);
                self.bind(&desc.out, y)
            }
            BaseOperationIr::Equal(desc) => self.comparison("EQ", desc),
            BaseOperationIr::EqualElem(desc) => self.comparison_scalar("EQ", desc),
            BaseOperationIr::RepeatDim(desc) => {
                let x = self.input(&desc.tensor)?;
                let mut expanded = x.ty.dims.clone();
                expanded.insert(desc.dim, desc.times);
                let mapping = (0..x.ty.rank())
                    .map(|d| if d < desc.dim { d } else { d + 1 })
                    .collect::<Vec<_>>();
                let y = self.broadcast_in_dim(&x, &expanded, &mapping);
                let y = self.reshape(&y, &desc.out.shape);
                self.bind(&desc.out, y)
            }
            BaseOperationIr::Cat(desc) => {
                let values = desc
                    .tensors
                    .iter()
                    .map(|t| self.input(t))
                    .collect::<Result<Vec<_>>>()?;
                let refs = values.iter().collect::<Vec<_>>();
                let y = self.concatenate(&refs, desc.dim)?;
                self.bind(&desc.out, y)
            }
            BaseOperationIr::Cast(desc) => {
                let x = self.input(&desc.input)?;
                let elem = self.elem(desc.out.dtype)?;
                let y = self.convert(&x, elem);
                self.bind(&desc.out, y)
            }
            BaseOperationIr::Empty(desc) | BaseOperationIr::Zeros(desc) => {
                let ty = self.ty(&desc.out)?;
                let y = self.filled(0.0, &ty);
                self.bind(&desc.out, y)
            }
            BaseOperationIr::Ones(desc) => {
                let ty = self.ty(&desc.out)?;
                let y = self.filled(1.0, &ty);
                self.bind(&desc.out, y)
            }
            _ => self.unsupported(""),
        }
    }

    /// Start, limit and stride per dimension of Burn slices (missing ranges
    /// take the whole dimension).
    #[allow(clippy::type_complexity)]
    fn slice_bounds(
        &self,
        dims: &[usize],
        ranges: &[Slice],
    ) -> Result<(Vec<usize>, Vec<usize>, Vec<usize>)> {
        let mut start = Vec::with_capacity(dims.len());
        let mut limit = Vec::with_capacity(dims.len());
        let mut strides = Vec::with_capacity(dims.len());
        for (d, &size) in dims.iter().enumerate() {
            match ranges.get(d) {
                Some(slice) => {
                    let (range, step) = slice.to_range_and_step(size);
                    if step <= 0 {
                        return self.unsupported("slice with a negative step");
                    }
                    start.push(range.start);
                    limit.push(range.end.max(range.start));
                    strides.push(step as usize);
                }
                None => {
                    start.push(0);
                    limit.push(size);
                    strides.push(1);
                }
            }
        }
        Ok((start, limit, strides))
    }

    /// Burn's `gather(dim, x, indices)`: `out[i][j] = x[i][indices[i][j]]`
    /// for `dim = 1`, indices of the output's shape.
    fn gather_along(&mut self, x: &Value, dim: usize, indices: &Value) -> Result<Value> {
        let dims = indices.ty.dims.clone();
        let rank = dims.len();
        if rank != x.ty.rank() {
            return self.internal("gather indices must have the tensor's rank");
        }
        let full = self.full_indices(dim, indices)?;
        let all = (0..rank).collect::<Vec<_>>();
        Ok(self.gather(x, &full, &[], &all, &all, rank, &vec![1; rank], dims))
    }

    /// The full index `[..., rank]` of every element of `indices` with its
    /// own coordinates, except along `dim`, where it is the index's value.
    fn full_indices(&mut self, dim: usize, indices: &Value) -> Result<Value> {
        let dims = indices.ty.dims.clone();
        let rank = dims.len();
        let mut with_vector = dims.clone();
        with_vector.push(1);
        let indices = self.convert(indices, ElementType::S64);
        let mut parts = Vec::with_capacity(rank);
        for d in 0..rank {
            let part = if d == dim {
                indices.clone()
            } else {
                self.iota(&dims, d, ElementType::S64)
            };
            parts.push(self.reshape(&part, &with_vector));
        }
        let refs = parts.iter().collect::<Vec<_>>();
        self.concatenate(&refs, rank)
    }

    /// `scatter` of `updates` into `operand` at `indices`, combining with
    /// the existing values as `update` says.
    fn scatter(
        &mut self,
        operand: &Value,
        indices: &Value,
        updates: &Value,
        numbers: &ScatterNumbers<'_>,
        update: IndexingUpdateOp,
    ) -> Value {
        let scalar = TensorType::new(Vec::new(), operand.ty.elem).mlir();
        let result = self.fresh();
        let a = self.fresh();
        let b = self.fresh();
        let c = self.fresh();
        let combine = match update {
            IndexingUpdateOp::Assign => None,
            IndexingUpdateOp::Add => Some("stablehlo.add"),
            IndexingUpdateOp::Mul => Some("stablehlo.multiply"),
            IndexingUpdateOp::Min => Some("stablehlo.minimum"),
            IndexingUpdateOp::Max => Some("stablehlo.maximum"),
        };
        let (line, returned) = match combine {
            Some(op) => (
                format!("      {c} = \"{op}\"({a}, {b}) : ({scalar}, {scalar}) -> {scalar}\n"),
                c.clone(),
            ),
            None => (String::new(), b.clone()),
        };
        let mut fields = Vec::new();
        if !numbers.update_window_dims.is_empty() {
            fields.push(format!(
                "update_window_dims = {}",
                list(numbers.update_window_dims)
            ));
        }
        if !numbers.inserted_window_dims.is_empty() {
            fields.push(format!(
                "inserted_window_dims = {}",
                list(numbers.inserted_window_dims)
            ));
        }
        fields.push(format!(
            "scatter_dims_to_operand_dims = {}",
            list(numbers.scatter_dims_to_operand_dims)
        ));
        fields.push(format!("index_vector_dim = {}", numbers.index_vector_dim));
        let _ = writeln!(
            self.body,
            "    {result} = \"stablehlo.scatter\"({}, {}, {}) ({{\n    ^bb0({a}: {scalar}, {b}: {scalar}):\n{line}      \"stablehlo.return\"({returned}) : ({scalar}) -> ()\n    }}) {{indices_are_sorted = false, scatter_dimension_numbers = #stablehlo.scatter<{}>, unique_indices = false}} : ({}, {}, {}) -> {}",
            operand.name,
            indices.name,
            updates.name,
            fields.join(", "),
            operand.ty.mlir(),
            indices.ty.mlir(),
            updates.ty.mlir(),
            operand.ty.mlir()
        );
        Value {
            name: result,
            ty: operand.ty.clone(),
        }
    }

    fn binary_op(&mut self, name: &str, desc: &BinaryOpIr) -> Result<()> {
        let dims = desc.out.shape.to_vec();
        let a = self.input(&desc.lhs)?;
        let b = self.input(&desc.rhs)?;
        let a = self.broadcast(&a, &dims);
        let b = self.broadcast(&b, &dims);
        let b = self.convert(&b, a.ty.elem);
        let y = self.binary(name, &a, &b);
        self.bind(&desc.out, y)
    }

    fn scalar_op(&mut self, name: &str, desc: &ScalarOpIr) -> Result<()> {
        let a = self.input(&desc.lhs)?;
        let s = self.scalar(desc.rhs, a.ty.elem);
        let b = self.broadcast(&s, &a.ty.dims);
        let y = self.binary(name, &a, &b);
        self.bind(&desc.out, y)
    }

    fn unary_op(&mut self, name: &str, desc: &UnaryOpIr) -> Result<()> {
        let x = self.input(&desc.input)?;
        let y = self.unary(name, &x);
        self.bind(&desc.out, y)
    }

    fn comparison(&mut self, direction: &str, desc: &BinaryOpIr) -> Result<()> {
        let dims = desc.out.shape.to_vec();
        let a = self.input(&desc.lhs)?;
        let b = self.input(&desc.rhs)?;
        let a = self.broadcast(&a, &dims);
        let b = self.broadcast(&b, &dims);
        let b = self.convert(&b, a.ty.elem);
        let y = self.compare(direction, &a, &b);
        self.bind(&desc.out, y)
    }

    fn comparison_scalar(&mut self, direction: &str, desc: &ScalarOpIr) -> Result<()> {
        let a = self.input(&desc.lhs)?;
        let s = self.scalar(desc.rhs, a.ty.elem);
        let b = self.broadcast(&s, &a.ty.dims);
        let y = self.compare(direction, &a, &b);
        self.bind(&desc.out, y)
    }

    /// Python's remainder: the result takes the sign of the divisor.
    fn remainder(&mut self, a: &Value, b: &Value) -> Value {
        let r = self.binary("stablehlo.remainder", a, b);
        if is_unsigned(a.ty.elem) {
            return r;
        }
        let zero = self.filled(0.0, &a.ty);
        let nonzero = self.compare("NE", &r, &zero);
        let r_negative = self.compare("LT", &r, &zero);
        let b_negative = self.compare("LT", b, &zero);
        let signs_differ = self.binary("stablehlo.xor", &r_negative, &b_negative);
        let fix = self.binary("stablehlo.and", &nonzero, &signs_differ);
        let shifted = self.binary("stablehlo.add", &r, b);
        self.select(&fix, &shifted, &r)
    }

    /// Reduces over `axis` keeping it (size 1), in f32 for half types.
    fn reduce_dim(&mut self, desc: &ReduceDimOpIr, kind: Reduction) -> Result<()> {
        let x = self.input(&desc.input)?;
        let y = self.reduction(&x, &[desc.axis], kind);
        self.bind(&desc.out, y)
    }

    fn reduction(&mut self, x: &Value, axes: &[usize], kind: Reduction) -> Value {
        let elem = x.ty.elem;
        let wide = matches!(kind, Reduction::Sum | Reduction::Mean | Reduction::Prod)
            && matches!(elem, ElementType::F16 | ElementType::BF16);
        let x = if wide {
            self.convert(x, ElementType::F32)
        } else {
            x.clone()
        };
        let (combiner, init) = match kind {
            Reduction::Sum | Reduction::Mean => ("stablehlo.add", 0.0),
            Reduction::Prod => ("stablehlo.multiply", 1.0),
            Reduction::Max => ("stablehlo.maximum", lowest(elem)),
            Reduction::Min => ("stablehlo.minimum", highest(elem)),
        };
        let mut y = self.reduce(&x, axes, combiner, init);
        if kind == Reduction::Mean {
            let count: usize = axes.iter().map(|&a| x.ty.dims[a]).product();
            let n = self.filled(count as f64, &y.ty);
            y = self.binary("stablehlo.divide", &y, &n);
        }
        self.convert(&y, elem)
    }

    fn lower_numeric(&mut self, op: &NumericOperationIr) -> Result<()> {
        match op {
            NumericOperationIr::Add(desc) => self.binary_op("stablehlo.add", desc),
            NumericOperationIr::Sub(desc) => self.binary_op("stablehlo.subtract", desc),
            NumericOperationIr::Mul(desc) => self.binary_op("stablehlo.multiply", desc),
            NumericOperationIr::Div(desc) => self.binary_op("stablehlo.divide", desc),
            NumericOperationIr::AddScalar(desc) => self.scalar_op("stablehlo.add", desc),
            NumericOperationIr::SubScalar(desc) => self.scalar_op("stablehlo.subtract", desc),
            NumericOperationIr::MulScalar(desc) => self.scalar_op("stablehlo.multiply", desc),
            NumericOperationIr::DivScalar(desc) => self.scalar_op("stablehlo.divide", desc),
            NumericOperationIr::Rem(desc) => {
                let dims = desc.out.shape.to_vec();
                let a = self.input(&desc.lhs)?;
                let b = self.input(&desc.rhs)?;
                let a = self.broadcast(&a, &dims);
                let b = self.broadcast(&b, &dims);
                let y = self.remainder(&a, &b);
                self.bind(&desc.out, y)
            }
            NumericOperationIr::RemScalar(desc) => {
                let a = self.input(&desc.lhs)?;
                let s = self.scalar(desc.rhs, a.ty.elem);
                let b = self.broadcast(&s, &a.ty.dims);
                let y = self.remainder(&a, &b);
                self.bind(&desc.out, y)
            }
            NumericOperationIr::Abs(desc) => self.unary_op("stablehlo.abs", desc),
            NumericOperationIr::Full(desc) => {
                let ty = self.ty(&desc.out)?;
                let s = self.scalar(desc.value, ty.elem);
                let y = self.broadcast(&s, &ty.dims);
                self.bind(&desc.out, y)
            }
            NumericOperationIr::MeanDim(desc) => self.reduce_dim(desc, Reduction::Mean),
            NumericOperationIr::SumDim(desc) => self.reduce_dim(desc, Reduction::Sum),
            NumericOperationIr::ProdDim(desc) => self.reduce_dim(desc, Reduction::Prod),
            NumericOperationIr::MaxDim(desc) => self.reduce_dim(desc, Reduction::Max),
            NumericOperationIr::MinDim(desc) => self.reduce_dim(desc, Reduction::Min),
            NumericOperationIr::MaxAbsDim(desc) => {
                let x = self.input(&desc.input)?;
                let a = self.unary("stablehlo.abs", &x);
                let y = self.reduction(&a, &[desc.axis], Reduction::Max);
                self.bind(&desc.out, y)
            }
            NumericOperationIr::Mean(desc)
            | NumericOperationIr::Sum(desc)
            | NumericOperationIr::Prod(desc)
            | NumericOperationIr::Max(desc)
            | NumericOperationIr::Min(desc)
            | NumericOperationIr::MaxAbs(desc) => {
                let kind = match op {
                    NumericOperationIr::Mean(_) => Reduction::Mean,
                    NumericOperationIr::Sum(_) => Reduction::Sum,
                    NumericOperationIr::Prod(_) => Reduction::Prod,
                    NumericOperationIr::Min(_) => Reduction::Min,
                    _ => Reduction::Max,
                };
                let mut x = self.input(&desc.input)?;
                if matches!(op, NumericOperationIr::MaxAbs(_)) {
                    x = self.unary("stablehlo.abs", &x);
                }
                let axes = (0..x.ty.rank()).collect::<Vec<_>>();
                let y = self.reduction(&x, &axes, kind);
                self.bind(&desc.out, y)
            }
            NumericOperationIr::Greater(desc) => self.comparison("GT", desc),
            NumericOperationIr::GreaterEqual(desc) => self.comparison("GE", desc),
            NumericOperationIr::Lower(desc) => self.comparison("LT", desc),
            NumericOperationIr::LowerEqual(desc) => self.comparison("LE", desc),
            NumericOperationIr::GreaterElem(desc) => self.comparison_scalar("GT", desc),
            NumericOperationIr::GreaterEqualElem(desc) => self.comparison_scalar("GE", desc),
            NumericOperationIr::LowerElem(desc) => self.comparison_scalar("LT", desc),
            NumericOperationIr::LowerEqualElem(desc) => self.comparison_scalar("LE", desc),
            NumericOperationIr::Clamp(desc) => {
                let x = self.input(&desc.tensor)?;
                let min = self.scalar(desc.min, x.ty.elem);
                let max = self.scalar(desc.max, x.ty.elem);
                let ty = x.ty.clone();
                let y = self.emit("stablehlo.clamp", &[&min, &x, &max], "", ty);
                self.bind(&desc.out, y)
            }
            NumericOperationIr::Powi(desc) => self.binary_op("stablehlo.power", desc),
            NumericOperationIr::PowiScalar(desc) => self.scalar_op("stablehlo.power", desc),
            NumericOperationIr::ArgMax(desc) | NumericOperationIr::ArgMin(desc) => {
                let max = matches!(op, NumericOperationIr::ArgMax(_));
                let x = self.input(&desc.input)?;
                let out_elem = self.elem(desc.out.dtype)?;
                let y = self.arg_reduce(&x, desc.axis, max, out_elem)?;
                self.bind(&desc.out, y)
            }
            NumericOperationIr::MaxDimWithIndices(desc)
            | NumericOperationIr::MinDimWithIndices(desc) => {
                let max = matches!(op, NumericOperationIr::MaxDimWithIndices(_));
                let x = self.input(&desc.tensor)?;
                let kind = if max { Reduction::Max } else { Reduction::Min };
                let values = self.reduction(&x, &[desc.dim], kind);
                self.bind(&desc.out, values)?;
                let index_elem = self.elem(desc.out_indices.dtype)?;
                let indices = self.arg_reduce(&x, desc.dim, max, index_elem)?;
                self.bind(&desc.out_indices, indices)
            }
            NumericOperationIr::CumSum(desc)
            | NumericOperationIr::CumProd(desc)
            | NumericOperationIr::CumMax(desc)
            | NumericOperationIr::CumMin(desc) => {
                let x = self.input(&desc.input)?;
                let elem = x.ty.elem;
                let (combiner, init) = match op {
                    NumericOperationIr::CumSum(_) => ("stablehlo.add", 0.0),
                    NumericOperationIr::CumProd(_) => ("stablehlo.multiply", 1.0),
                    NumericOperationIr::CumMax(_) => ("stablehlo.maximum", lowest(elem)),
                    _ => ("stablehlo.minimum", highest(elem)),
                };
                // A window reaching back over the whole axis.
                let n = x.ty.dims[desc.axis];
                let rank = x.ty.rank();
                let mut window = vec![1; rank];
                window[desc.axis] = n;
                let mut padding = vec![(0, 0); rank];
                padding[desc.axis] = (n.saturating_sub(1), 0);
                let y = self.reduce_window(&x, &window, &vec![1; rank], &padding, combiner, init);
                self.bind(&desc.out, y)
            }
            _ => self.unsupported(""),
        }
    }

    /// Index of the first maximum (or minimum) along `axis`, kept as size 1:
    /// the extreme value, then the smallest index holding it.
    fn arg_reduce(
        &mut self,
        x: &Value,
        axis: usize,
        max: bool,
        out_elem: ElementType,
    ) -> Result<Value> {
        let kind = if max { Reduction::Max } else { Reduction::Min };
        let extreme = self.reduction(x, &[axis], kind);
        let mut kept = x.ty.dims.clone();
        kept[axis] = 1;
        let extreme = self.reshape(&extreme, &kept);
        let extreme = self.broadcast(&extreme, &x.ty.dims);
        let hit = self.compare("EQ", x, &extreme);
        let index = self.iota(&x.ty.dims, axis, ElementType::S64);
        let size = x.ty.dims[axis];
        let beyond = self.filled(size as f64, &index.ty);
        let candidates = self.select(&hit, &index, &beyond);
        let first = self.reduce(&candidates, &[axis], "stablehlo.minimum", i64::MAX as f64);
        let first = self.reshape(&first, &kept);
        Ok(self.convert(&first, out_elem))
    }

    fn lower_float(&mut self, op: &FloatOperationIr) -> Result<()> {
        match op {
            FloatOperationIr::Exp(d) => self.unary_op("stablehlo.exponential", d),
            FloatOperationIr::Log(d) => self.unary_op("stablehlo.log", d),
            FloatOperationIr::Log1p(d) => self.unary_op("stablehlo.log_plus_one", d),
            FloatOperationIr::Erf(d) => self.unary_op("chlo.erf", d),
            FloatOperationIr::Sqrt(d) => self.unary_op("stablehlo.sqrt", d),
            FloatOperationIr::Cos(d) => self.unary_op("stablehlo.cosine", d),
            FloatOperationIr::Sin(d) => self.unary_op("stablehlo.sine", d),
            FloatOperationIr::Tanh(d) => self.unary_op("stablehlo.tanh", d),
            FloatOperationIr::Tan(d) => self.unary_op("chlo.tan", d),
            FloatOperationIr::Cosh(d) => self.unary_op("chlo.cosh", d),
            FloatOperationIr::Sinh(d) => self.unary_op("chlo.sinh", d),
            FloatOperationIr::ArcCos(d) => self.unary_op("chlo.acos", d),
            FloatOperationIr::ArcCosh(d) => self.unary_op("chlo.acosh", d),
            FloatOperationIr::ArcSin(d) => self.unary_op("chlo.asin", d),
            FloatOperationIr::ArcSinh(d) => self.unary_op("chlo.asinh", d),
            FloatOperationIr::ArcTan(d) => self.unary_op("chlo.atan", d),
            FloatOperationIr::ArcTanh(d) => self.unary_op("chlo.atanh", d),
            FloatOperationIr::ArcTan2(d) => self.binary_op("stablehlo.atan2", d),
            FloatOperationIr::Round(d) => self.unary_op("stablehlo.round_nearest_even", d),
            FloatOperationIr::Floor(d) => self.unary_op("stablehlo.floor", d),
            FloatOperationIr::Ceil(d) => self.unary_op("stablehlo.ceil", d),
            FloatOperationIr::Trunc(d) => {
                let x = self.input(&d.input)?;
                let zero = self.filled(0.0, &x.ty);
                let negative = self.compare("LT", &x, &zero);
                let up = self.unary("stablehlo.ceil", &x);
                let down = self.unary("stablehlo.floor", &x);
                let y = self.select(&negative, &up, &down);
                self.bind(&d.out, y)
            }
            FloatOperationIr::Recip(d) => {
                let x = self.input(&d.input)?;
                let one = self.filled(1.0, &x.ty);
                let y = self.binary("stablehlo.divide", &one, &x);
                self.bind(&d.out, y)
            }
            FloatOperationIr::IsNan(d) => {
                let x = self.input(&d.input)?;
                let y = self.compare("NE", &x, &x);
                self.bind(&d.out, y)
            }
            FloatOperationIr::IsInf(d) => {
                let x = self.input(&d.input)?;
                let a = self.unary("stablehlo.abs", &x);
                let inf = self.filled(f64::INFINITY, &x.ty);
                let y = self.compare("EQ", &a, &inf);
                self.bind(&d.out, y)
            }
            FloatOperationIr::PowfScalar(d) => self.scalar_op("stablehlo.power", d),
            FloatOperationIr::Powf(d) => self.binary_op("stablehlo.power", d),
            FloatOperationIr::IntoInt(d) => {
                let x = self.input(&d.input)?;
                let elem = self.elem(d.out.dtype)?;
                let y = self.convert(&x, elem);
                self.bind(&d.out, y)
            }
            FloatOperationIr::Matmul(d) => self.matmul(&d.lhs, &d.rhs, &d.out),
            FloatOperationIr::Random(d) => {
                let ty = self.ty(&d.out)?;
                let y = self.random(&ty, d.distribution)?;
                self.bind(&d.out, y)
            }
            _ => self.unsupported(""),
        }
    }

    fn lower_int(&mut self, op: &IntOperationIr) -> Result<()> {
        match op {
            IntOperationIr::IntoFloat(d) => {
                let x = self.input(&d.input)?;
                let elem = self.elem(d.out.dtype)?;
                let y = self.convert(&x, elem);
                self.bind(&d.out, y)
            }
            IntOperationIr::BitwiseAnd(d) => self.binary_op("stablehlo.and", d),
            IntOperationIr::BitwiseOr(d) => self.binary_op("stablehlo.or", d),
            IntOperationIr::BitwiseXor(d) => self.binary_op("stablehlo.xor", d),
            IntOperationIr::BitwiseNot(d) => self.unary_op("stablehlo.not", d),
            IntOperationIr::BitwiseAndScalar(d) => self.scalar_op("stablehlo.and", d),
            IntOperationIr::BitwiseOrScalar(d) => self.scalar_op("stablehlo.or", d),
            IntOperationIr::BitwiseXorScalar(d) => self.scalar_op("stablehlo.xor", d),
            IntOperationIr::BitwiseLeftShift(d) => self.binary_op("stablehlo.shift_left", d),
            IntOperationIr::BitwiseLeftShiftScalar(d) => self.scalar_op("stablehlo.shift_left", d),
            IntOperationIr::BitwiseRightShift(d) => {
                self.binary_op("stablehlo.shift_right_arithmetic", d)
            }
            IntOperationIr::BitwiseRightShiftScalar(d) => {
                self.scalar_op("stablehlo.shift_right_arithmetic", d)
            }
            IntOperationIr::Matmul(d) => self.matmul(&d.lhs, &d.rhs, &d.out),
        }
    }

    fn lower_bool(&mut self, op: &BoolOperationIr) -> Result<()> {
        match op {
            BoolOperationIr::IntoFloat(d) | BoolOperationIr::IntoInt(d) => {
                let x = self.input(&d.input)?;
                let elem = self.elem(d.out.dtype)?;
                let y = self.convert(&x, elem);
                self.bind(&d.out, y)
            }
            BoolOperationIr::Not(d) => self.unary_op("stablehlo.not", d),
            BoolOperationIr::And(d) => self.binary_op("stablehlo.and", d),
            BoolOperationIr::Or(d) => self.binary_op("stablehlo.or", d),
        }
    }

    /// Batched matmul `[..., m, k] x [..., k, n]`, batch dims broadcast.
    fn matmul(&mut self, lhs: &TensorIr, rhs: &TensorIr, out: &TensorIr) -> Result<()> {
        let a = self.input(lhs)?;
        let b = self.input(rhs)?;
        let out_dims = out.shape.to_vec();
        let rank = out_dims.len();
        if rank < 2 || a.ty.rank() != rank || b.ty.rank() != rank {
            return self.unsupported("matmul of tensors of different ranks or rank < 2");
        }
        let batch = &out_dims[..rank - 2];
        let (m, k, n) = (
            a.ty.dims[rank - 2],
            a.ty.dims[rank - 1],
            b.ty.dims[rank - 1],
        );
        let a = self.broadcast(&a, &[batch, &[m, k]].concat());
        let b = self.broadcast(&b, &[batch, &[k, n]].concat());
        let b = self.convert(&b, a.ty.elem);
        let batch_dims = (0..rank - 2).collect::<Vec<_>>();
        let y = self.dot_general(
            &a,
            &b,
            (&batch_dims, &batch_dims),
            (&[rank - 1], &[rank - 2]),
            out_dims,
        );
        self.bind(out, y)
    }

    fn lower_module(&mut self, op: &ModuleOperationIr) -> Result<()> {
        match op {
            ModuleOperationIr::Embedding(d) => {
                let weights = self.input(&d.weights)?;
                let indices = self.input(&d.indices)?;
                let indices = self.convert(&indices, ElementType::S64);
                let rank = indices.ty.rank();
                let width = weights.ty.dims[1];
                let mut dims = indices.ty.dims.clone();
                dims.push(width);
                let y = self.gather(
                    &weights,
                    &indices,
                    &[rank],
                    &[0],
                    &[0],
                    rank,
                    &[1, width],
                    dims,
                );
                self.bind(&d.out, y)
            }
            ModuleOperationIr::Linear(d) => {
                let x = self.input(&d.x)?;
                let w = self.input(&d.weight)?;
                let rank = x.ty.rank();
                let mut dims = x.ty.dims.clone();
                let outputs = w.ty.dims[1];
                dims[rank - 1] = outputs;
                let mut y = self.dot_general(&x, &w, (&[], &[]), (&[rank - 1], &[0]), dims.clone());
                if let Some(bias) = &d.bias {
                    let b = self.input(bias)?;
                    let b = self.broadcast_in_dim(&b, &dims, &[rank - 1]);
                    y = self.binary("stablehlo.add", &y, &b);
                }
                self.bind(&d.out, y)
            }
            ModuleOperationIr::Conv1d(d) => self.convolution(
                &d.x,
                &d.weight,
                d.bias.as_ref(),
                &d.options.stride,
                &d.options.padding,
                &d.options.dilation,
                d.options.groups,
                &d.out,
            ),
            ModuleOperationIr::Conv2d(d) => self.convolution(
                &d.x,
                &d.weight,
                d.bias.as_ref(),
                &d.options.stride,
                &d.options.padding,
                &d.options.dilation,
                d.options.groups,
                &d.out,
            ),
            ModuleOperationIr::Conv3d(d) => self.convolution(
                &d.x,
                &d.weight,
                d.bias.as_ref(),
                &d.options.stride,
                &d.options.padding,
                &d.options.dilation,
                d.options.groups,
                &d.out,
            ),
            ModuleOperationIr::ConvTranspose1d(d) => self.conv_transpose(
                &d.x,
                &d.weight,
                d.bias.as_ref(),
                &d.options.stride,
                &d.options.padding,
                &d.options.padding_out,
                &d.options.dilation,
                d.options.groups,
                &d.out,
            ),
            ModuleOperationIr::ConvTranspose2d(d) => self.conv_transpose(
                &d.x,
                &d.weight,
                d.bias.as_ref(),
                &d.options.stride,
                &d.options.padding,
                &d.options.padding_out,
                &d.options.dilation,
                d.options.groups,
                &d.out,
            ),
            ModuleOperationIr::ConvTranspose3d(d) => self.conv_transpose(
                &d.x,
                &d.weight,
                d.bias.as_ref(),
                &d.options.stride,
                &d.options.padding,
                &d.options.padding_out,
                &d.options.dilation,
                d.options.groups,
                &d.out,
            ),
            ModuleOperationIr::Interpolate(d) if d.options.mode == InterpolateModeIr::Bilinear => {
                let x = self.input(&d.x)?;
                let elem = x.ty.elem;
                let mut y = if is_float(elem) && elem != ElementType::F64 {
                    self.convert(&x, ElementType::F32)
                } else {
                    x.clone()
                };
                for (axis, &out_size) in [2usize, 3].iter().zip(&d.output_size) {
                    let in_size = x.ty.dims[*axis];
                    y = self.linear_resize(&y, *axis, in_size, out_size, d.options.align_corners);
                }
                let y = self.convert(&y, elem);
                self.bind(&d.out, y)
            }
            ModuleOperationIr::Interpolate(d) => {
                if d.options.mode != InterpolateModeIr::Nearest {
                    return self.unsupported(&format!(
                        "interpolation mode {:?}; nearest and bilinear are lowered",
                        d.options.mode
                    ));
                }
                let x = self.input(&d.x)?;
                let mut y = x.clone();
                for (axis, &out_size) in [2usize, 3].iter().zip(&d.output_size) {
                    let in_size = x.ty.dims[*axis];
                    if in_size == out_size {
                        continue;
                    }
                    // floor(o * in / out), exactly, in integers.
                    let o = self.iota(&[out_size], 0, ElementType::S64);
                    let scale = self.filled(in_size as f64, &o.ty);
                    let scaled = self.binary("stablehlo.multiply", &o, &scale);
                    let divisor = self.filled(out_size as f64, &o.ty);
                    let index = self.binary("stablehlo.divide", &scaled, &divisor);
                    y = self.take(&y, *axis, &index);
                }
                self.bind(&d.out, y)
            }
            ModuleOperationIr::Attention(d) => self.attention(d),
            ModuleOperationIr::AvgPool2d(d) => {
                if d.ceil_mode {
                    return self.unsupported("ceil_mode");
                }
                let x = self.input(&d.x)?;
                let window = [1, 1, d.kernel_size[0], d.kernel_size[1]];
                let strides = [1, 1, d.stride[0], d.stride[1]];
                let padding = [
                    (0, 0),
                    (0, 0),
                    (d.padding[0], d.padding[0]),
                    (d.padding[1], d.padding[1]),
                ];
                let wide = self.convert(
                    &x,
                    if is_float(x.ty.elem) && x.ty.elem != ElementType::F64 {
                        ElementType::F32
                    } else {
                        x.ty.elem
                    },
                );
                let sum =
                    self.reduce_window(&wide, &window, &strides, &padding, "stablehlo.add", 0.0);
                let count = if d.count_include_pad || (d.padding == [0, 0]) {
                    let n = (d.kernel_size[0] * d.kernel_size[1]) as f64;
                    self.filled(n, &sum.ty)
                } else {
                    let ones = self.filled(1.0, &wide.ty);
                    self.reduce_window(&ones, &window, &strides, &padding, "stablehlo.add", 0.0)
                };
                let y = self.binary("stablehlo.divide", &sum, &count);
                let y = self.convert(&y, x.ty.elem);
                self.bind(&d.out, y)
            }
            ModuleOperationIr::MaxPool2d(d) => {
                if d.ceil_mode || d.dilation != [1, 1] {
                    return self.unsupported("ceil_mode or dilation");
                }
                let x = self.input(&d.x)?;
                let window = [1, 1, d.kernel_size[0], d.kernel_size[1]];
                let strides = [1, 1, d.stride[0], d.stride[1]];
                let padding = [
                    (0, 0),
                    (0, 0),
                    (d.padding[0], d.padding[0]),
                    (d.padding[1], d.padding[1]),
                ];
                let y = self.reduce_window(
                    &x,
                    &window,
                    &strides,
                    &padding,
                    "stablehlo.maximum",
                    lowest(x.ty.elem),
                );
                self.bind(&d.out, y)
            }
            _ => self.unsupported(""),
        }
    }

    /// `reduce_window` with a binary combiner.
    fn reduce_window(
        &mut self,
        x: &Value,
        window: &[usize],
        strides: &[usize],
        padding: &[(usize, usize)],
        combiner: &str,
        init: f64,
    ) -> Value {
        let init = self.constant(init, x.ty.elem);
        let dims =
            x.ty.dims
                .iter()
                .enumerate()
                .map(|(i, &d)| {
                    let padded = d + padding[i].0 + padding[i].1;
                    if padded < window[i] {
                        0
                    } else {
                        (padded - window[i]) / strides[i] + 1
                    }
                })
                .collect::<Vec<_>>();
        let ty = x.ty.with_dims(dims);
        let scalar = TensorType::new(Vec::new(), x.ty.elem).mlir();
        let result = self.fresh();
        let a = self.fresh();
        let b = self.fresh();
        let c = self.fresh();
        let _ = writeln!(
            self.body,
            "    {result} = \"stablehlo.reduce_window\"({}, {}) ({{\n    ^bb0({a}: {scalar}, {b}: {scalar}):\n      {c} = \"{combiner}\"({a}, {b}) : ({scalar}, {scalar}) -> {scalar}\n      \"stablehlo.return\"({c}) : ({scalar}) -> ()\n    }}) {{padding = dense<[{}]> : tensor<{}x2xi64>, window_dimensions = {}, window_strides = {}}} : ({}, {scalar}) -> {}",
            x.name,
            init.name,
            padding.iter().map(|(lo, hi)| format!("[{lo}, {hi}]")).collect::<Vec<_>>().join(", "),
            padding.len(),
            i64_array(window),
            i64_array(strides),
            x.ty.mlir(),
            ty.mlir()
        );
        Value { name: result, ty }
    }

    /// N-d convolution, NC(spatial) input and OI(spatial) kernel, plus bias.
    #[allow(clippy::too_many_arguments)]
    fn convolution(
        &mut self,
        x: &TensorIr,
        weight: &TensorIr,
        bias: Option<&TensorIr>,
        stride: &[usize],
        padding: &[usize],
        dilation: &[usize],
        groups: usize,
        out: &TensorIr,
    ) -> Result<()> {
        let x = self.input(x)?;
        let spatial = (0..stride.len()).map(|i| i.to_string()).collect::<Vec<_>>();
        let layout = |a: &str, b: &str| format!("[{a}, {b}, {}]", spatial.join(", "));
        // A weight argument, spatial dimensions first (`with_kernels_last`).
        let kernels_last = self.kernels_last && groups == 1 && !self.has_value(weight.id);
        let (w, kernel_layout) = if kernels_last {
            let rank = weight.shape.len();
            let permutation = (2..rank).chain([1, 0]).collect::<Vec<_>>();
            let w = self.permuted_input(weight, &permutation)?;
            (w, format!("[{}, i, o]", spatial.join(", ")))
        } else {
            (self.input(weight)?, layout("o", "i"))
        };
        let w = self.convert(&w, x.ty.elem);
        let dims = out.shape.to_vec();
        let ty = x.ty.with_dims(dims.clone());
        let precision = if matches!(x.ty.elem, ElementType::F32 | ElementType::F64) {
            ", precision_config = [#stablehlo<precision HIGHEST>, #stablehlo<precision HIGHEST>]"
        } else {
            ""
        };
        let result = self.fresh();
        let _ = writeln!(
            self.body,
            "    {result} = stablehlo.convolution({}, {}) dim_numbers = {}x{}->{}, window = {{stride = {}, pad = [{}], rhs_dilate = {}}} {{batch_group_count = 1 : i64, feature_group_count = {groups} : i64{precision}}} : ({}, {}) -> {}",
            x.name,
            w.name,
            layout("b", "f"),
            kernel_layout,
            layout("b", "f"),
            list(stride),
            padding.iter().map(|p| format!("[{p}, {p}]")).collect::<Vec<_>>().join(", "),
            list(dilation),
            x.ty.mlir(),
            w.ty.mlir(),
            ty.mlir()
        );
        let mut y = Value { name: result, ty };
        if let Some(bias) = bias {
            let b = self.input(bias)?;
            let b = self.convert(&b, y.ty.elem);
            let b = self.broadcast_in_dim(&b, &dims, &[1]);
            y = self.binary("stablehlo.add", &y, &b);
        }
        self.bind(out, y)
    }

    /// Transposed convolution as a convolution of the input dilated by the
    /// stride, with the kernel flipped and its in/out features swapped per
    /// group. Burn's kernel is `[in, out / groups, k...]`.
    #[allow(clippy::too_many_arguments)]
    fn conv_transpose(
        &mut self,
        x: &TensorIr,
        weight: &TensorIr,
        bias: Option<&TensorIr>,
        stride: &[usize],
        padding: &[usize],
        padding_out: &[usize],
        dilation: &[usize],
        groups: usize,
        out: &TensorIr,
    ) -> Result<()> {
        let x = self.input(x)?;
        let w = self.input(weight)?;
        let w = self.convert(&w, x.ty.elem);
        let spatial_rank = stride.len();
        let (c_in, c_out_g) = (w.ty.dims[0], w.ty.dims[1]);
        let kernel = w.ty.dims[2..].to_vec();
        if groups == 0 || c_in % groups != 0 {
            return self.internal("groups must divide the input channels");
        }
        // [in, out/g, k] -> [g, in/g, out/g, k] -> [g, out/g, in/g, k] -> [out, in/g, k]
        let grouped = [&[groups, c_in / groups, c_out_g][..], &kernel].concat();
        let w = self.reshape(&w, &grouped);
        let mut permutation = vec![0, 2, 1];
        permutation.extend(3..3 + spatial_rank);
        let w = self.transpose(&w, &permutation);
        let oi = [&[groups * c_out_g, c_in / groups][..], &kernel].concat();
        let w = self.reshape(&w, &oi);
        let flip = (2..2 + spatial_rank).collect::<Vec<_>>();
        let w_ty = w.ty.clone();
        let w = self.emit(
            "stablehlo.reverse",
            &[&w],
            &format!("dimensions = {}", i64_array(&flip)),
            w_ty,
        );
        let pads = (0..spatial_rank)
            .map(|i| {
                let reach = (dilation[i] * (kernel[i] - 1)) as i64;
                let low = reach - padding[i] as i64;
                (low, low + padding_out[i] as i64)
            })
            .collect::<Vec<_>>();
        let spatial = (0..spatial_rank).map(|i| i.to_string()).collect::<Vec<_>>();
        let layout = |a: &str, b: &str| format!("[{a}, {b}, {}]", spatial.join(", "));
        let dims = out.shape.to_vec();
        let ty = x.ty.with_dims(dims.clone());
        let precision = if matches!(x.ty.elem, ElementType::F32 | ElementType::F64) {
            ", precision_config = [#stablehlo<precision HIGHEST>, #stablehlo<precision HIGHEST>]"
        } else {
            ""
        };
        let result = self.fresh();
        let _ = writeln!(
            self.body,
            "    {result} = stablehlo.convolution({}, {}) dim_numbers = {}x{}->{}, window = {{stride = {}, pad = [{}], lhs_dilate = {}, rhs_dilate = {}}} {{batch_group_count = 1 : i64, feature_group_count = {groups} : i64{precision}}} : ({}, {}) -> {}",
            x.name,
            w.name,
            layout("b", "f"),
            layout("o", "i"),
            layout("b", "f"),
            list(&vec![1; spatial_rank]),
            pads.iter().map(|(lo, hi)| format!("[{lo}, {hi}]")).collect::<Vec<_>>().join(", "),
            list(stride),
            list(dilation),
            x.ty.mlir(),
            w.ty.mlir(),
            ty.mlir()
        );
        let mut y = Value { name: result, ty };
        if let Some(bias) = bias {
            let b = self.input(bias)?;
            let b = self.convert(&b, y.ty.elem);
            let b = self.broadcast_in_dim(&b, &dims, &[1]);
            y = self.binary("stablehlo.add", &y, &b);
        }
        self.bind(out, y)
    }

    /// A rank-1 constant, fixed by the op's structure.
    fn dense(&mut self, values: &[f64], elem: ElementType) -> Value {
        let ty = TensorType::new(vec![values.len()], elem);
        let items = values
            .iter()
            .map(|&v| match elem {
                ElementType::S64 => format!("{}", v as i64),
                _ => format!("{:.9e}", v),
            })
            .collect::<Vec<_>>()
            .join(", ");
        self.emit(
            "stablehlo.constant",
            &[],
            &format!("value = dense<[{items}]> : {}", ty.mlir()),
            ty,
        )
    }

    /// Linear interpolation along `axis` as Burn's CPU backend does it:
    /// `x[lo] * (1 - w) + x[hi] * w`, the coordinates from the sizes.
    fn linear_resize(
        &mut self,
        x: &Value,
        axis: usize,
        in_size: usize,
        out_size: usize,
        align_corners: bool,
    ) -> Value {
        let ratio = if align_corners {
            (in_size as f64 - 1.0) / (out_size.max(1) - 1).max(1) as f64
        } else {
            in_size as f64 / out_size as f64
        };
        let mut low = Vec::with_capacity(out_size);
        let mut high = Vec::with_capacity(out_size);
        let mut weight = Vec::with_capacity(out_size);
        for o in 0..out_size {
            let coord = if align_corners {
                o as f64 * ratio
            } else {
                (o as f64 + 0.5) * ratio - 0.5
            };
            let lo = coord.floor().max(0.0) as usize;
            low.push(lo as f64);
            high.push(((lo + 1).min(in_size - 1)) as f64);
            weight.push((coord - lo as f64).max(0.0));
        }
        let low = self.dense(&low, ElementType::S64);
        let high = self.dense(&high, ElementType::S64);
        let w = self.dense(&weight, x.ty.elem);
        let a = self.take(x, axis, &low);
        let b = self.take(x, axis, &high);
        let dims = a.ty.dims.clone();
        let w = self.broadcast_in_dim(&w, &dims, &[axis]);
        let one = self.filled(1.0, &w.ty);
        let w_low = self.binary("stablehlo.subtract", &one, &w);
        let a = self.binary("stablehlo.multiply", &a, &w_low);
        let b = self.binary("stablehlo.multiply", &b, &w);
        self.binary("stablehlo.add", &a, &b)
    }

    /// softmax(scale * q k^T [softcap] [mask] [causal] [+ bias]) v, the
    /// softmax in f32 for half types, fully masked rows giving zeros like
    /// Burn's reference.
    fn attention(&mut self, d: &AttentionOpIr) -> Result<()> {
        let q = self.input(&d.query)?;
        let k = self.input(&d.key)?;
        let v = self.input(&d.value)?;
        let elem = q.ty.elem;
        if q.ty.rank() != 4 || k.ty.rank() != 4 || v.ty.rank() != 4 {
            return self.unsupported("attention on tensors that are not [batch, heads, seq, dim]");
        }
        let (b, h, lq, dk) = (q.ty.dims[0], q.ty.dims[1], q.ty.dims[2], q.ty.dims[3]);
        let lk = k.ty.dims[2];
        let dv = v.ty.dims[3];
        let scores = self.dot_general(&q, &k, (&[0, 1], &[0, 1]), (&[3], &[3]), vec![b, h, lq, lk]);
        let compute = if matches!(elem, ElementType::F16 | ElementType::BF16) {
            ElementType::F32
        } else {
            elem
        };
        let mut s = self.convert(&scores, compute);
        let scale = match d.options.scale {
            Some(scale) => scale,
            None => ScalarIr::Float(1.0 / (dk as f64).sqrt()),
        };
        let scale = self.scalar(scale, compute);
        let scale = self.broadcast(&scale, &s.ty.dims);
        s = self.binary("stablehlo.multiply", &s, &scale);
        if let Some(cap) = d.options.softcap {
            let cap = self.scalar(cap, compute);
            let cap = self.broadcast(&cap, &s.ty.dims);
            let scaled = self.binary("stablehlo.divide", &s, &cap);
            let t = self.unary("stablehlo.tanh", &scaled);
            s = self.binary("stablehlo.multiply", &t, &cap);
        }
        let dims = s.ty.dims.clone();
        let neg_inf = self.filled(f64::NEG_INFINITY, &s.ty);
        if let Some(mask) = &d.mask {
            let m = self.input(mask)?;
            let m = self.broadcast(&m, &dims);
            s = self.select(&m, &neg_inf, &s);
        }
        if d.options.is_causal {
            // Bottom-right aligned like Burn's reference: key j is in the
            // future of query i when j > i + (lk - lq).
            let mut row = self.iota(&dims, 2, ElementType::S64);
            if lk != lq {
                let offset = self.filled(lk as f64 - lq as f64, &row.ty);
                row = self.binary("stablehlo.add", &row, &offset);
            }
            let col = self.iota(&dims, 3, ElementType::S64);
            let future = self.compare("GT", &col, &row);
            s = self.select(&future, &neg_inf, &s);
        }
        if let Some(bias) = &d.attn_bias {
            let bias = self.input(bias)?;
            let bias = self.broadcast(&bias, &dims);
            let bias = self.convert(&bias, compute);
            s = self.binary("stablehlo.add", &s, &bias);
        }
        let max = self.reduce(&s, &[3], "stablehlo.maximum", f64::NEG_INFINITY);
        let floor = self.filled(lowest_finite(compute), &max.ty);
        let max = self.binary("stablehlo.maximum", &max, &floor);
        let max = self.broadcast_in_dim(&max, &dims, &[0, 1, 2]);
        let shifted = self.binary("stablehlo.subtract", &s, &max);
        let e = self.unary("stablehlo.exponential", &shifted);
        let sum = self.reduce(&e, &[3], "stablehlo.add", 0.0);
        let tiny = self.filled(min_positive(compute), &sum.ty);
        let sum = self.binary("stablehlo.maximum", &sum, &tiny);
        let sum = self.broadcast_in_dim(&sum, &dims, &[0, 1, 2]);
        let p = self.binary("stablehlo.divide", &e, &sum);
        let p = self.convert(&p, v.ty.elem);
        let y = self.dot_general(&p, &v, (&[0, 1], &[0, 1]), (&[3], &[2]), vec![b, h, lq, dv]);
        self.bind(&d.out, y)
    }

    /// Random numbers from `stablehlo.rng_bit_generator` (Threefry), its
    /// state an argument the caller draws from its seeded generator.
    fn random(&mut self, ty: &TensorType, distribution: Distribution) -> Result<Value> {
        if !is_float(ty.elem) {
            return self.unsupported("random integers");
        }
        let state_ty = TensorType::new(vec![2], ElementType::U64);
        let state = Value {
            name: format!("%arg{}", self.arguments.len()),
            ty: state_ty.clone(),
        };
        self.arguments.push((Argument::RngState, state_ty.clone()));
        let count: usize = ty.dims.iter().product();
        let normal = matches!(distribution, Distribution::Normal(..));
        let draws = if normal { 2 * count } else { count };
        let bits_ty = TensorType::new(vec![draws], ElementType::U32);
        let new_state = self.fresh();
        let bits_name = self.fresh();
        let _ = writeln!(
            self.body,
            "    {new_state}, {bits_name} = \"stablehlo.rng_bit_generator\"({}) {{rng_algorithm = #stablehlo<rng_algorithm THREE_FRY>}} : ({}) -> ({}, {})",
            state.name,
            state_ty.mlir(),
            state_ty.mlir(),
            bits_ty.mlir()
        );
        let bits = Value {
            name: bits_name,
            ty: bits_ty,
        };
        // Uniform [0, 1): the top 23 bits as the mantissa of a float in [1, 2).
        let nine = self.filled(9.0, &bits.ty);
        let mantissa = self.binary("stablehlo.shift_right_logical", &bits, &nine);
        let one_bits = self.filled(f64::from(0x3F80_0000u32), &bits.ty);
        let pattern = self.binary("stablehlo.or", &mantissa, &one_bits);
        let f32_ty = bits.ty.with_elem(ElementType::F32);
        let in_one_two = self.emit("stablehlo.bitcast_convert", &[&pattern], "", f32_ty.clone());
        let one = self.filled(1.0, &f32_ty);
        let u = self.binary("stablehlo.subtract", &in_one_two, &one);
        let flat_ty = TensorType::new(vec![count], ElementType::F32);
        let y = match distribution {
            Distribution::Default => u,
            Distribution::Uniform(low, high) => {
                let low = self.scalar(ScalarIr::Float(low), ElementType::F32);
                let high = self.scalar(ScalarIr::Float(high), ElementType::F32);
                let width = self.binary("stablehlo.subtract", &high, &low);
                let width = self.broadcast(&width, &[count]);
                let low = self.broadcast(&low, &[count]);
                let scaled = self.binary("stablehlo.multiply", &u, &width);
                self.binary("stablehlo.add", &scaled, &low)
            }
            Distribution::Bernoulli(p) => {
                let p = self.scalar(ScalarIr::Float(p), ElementType::F32);
                let p = self.broadcast(&p, &[count]);
                let hit = self.compare("LT", &u, &p);
                self.convert(&hit, ElementType::F32)
            }
            Distribution::Normal(mean, std) => {
                // Box-Muller on two halves of the draws.
                let u1 = self.slice(&u, &[0], &[count], &[1]);
                let u2 = self.slice(&u, &[count], &[2 * count], &[1]);
                let one = self.filled(1.0, &flat_ty);
                let u1 = self.binary("stablehlo.subtract", &one, &u1); // (0, 1]
                let log = self.unary("stablehlo.log", &u1);
                let minus_two = self.filled(-2.0, &flat_ty);
                let r2 = self.binary("stablehlo.multiply", &log, &minus_two);
                let r = self.unary("stablehlo.sqrt", &r2);
                let two_pi = self.filled(std::f64::consts::TAU, &flat_ty);
                let theta = self.binary("stablehlo.multiply", &u2, &two_pi);
                let c = self.unary("stablehlo.cosine", &theta);
                let z = self.binary("stablehlo.multiply", &r, &c);
                let mean = self.scalar(ScalarIr::Float(mean), ElementType::F32);
                let std = self.scalar(ScalarIr::Float(std), ElementType::F32);
                let mean = self.broadcast(&mean, &[count]);
                let std = self.broadcast(&std, &[count]);
                let z = self.binary("stablehlo.multiply", &z, &std);
                self.binary("stablehlo.add", &z, &mean)
            }
        };
        let y = self.reshape(&y, &ty.dims);
        Ok(self.convert(&y, ty.elem))
    }
}

/// The dimension numbers of a `stablehlo.scatter`.
struct ScatterNumbers<'a> {
    update_window_dims: &'a [usize],
    inserted_window_dims: &'a [usize],
    scatter_dims_to_operand_dims: &'a [usize],
    index_vector_dim: usize,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Reduction {
    Sum,
    Mean,
    Prod,
    Max,
    Min,
}

/// `array<i64: 1, 2>`.
fn i64_array(values: &[usize]) -> String {
    if values.is_empty() {
        return "array<i64>".to_string();
    }
    format!("array<i64: {}>", join(values))
}

/// `[1, 2]`.
fn list(values: &[usize]) -> String {
    format!("[{}]", join(values))
}

fn join(values: &[usize]) -> String {
    values
        .iter()
        .map(|v| v.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The MLIR literal of `value` as an `elem` (floats as exact bit patterns).
fn literal(value: f64, elem: ElementType) -> String {
    match elem {
        ElementType::F32 => format!("0x{:08X}", (value as f32).to_bits()),
        ElementType::F64 => format!("0x{:016X}", value.to_bits()),
        ElementType::F16 => format!("0x{:04X}", half::f16::from_f64(value).to_bits()),
        ElementType::BF16 => format!("0x{:04X}", half::bf16::from_f64(value).to_bits()),
        ElementType::Pred => (value != 0.0).to_string(),
        ElementType::U8 | ElementType::U16 | ElementType::U32 | ElementType::U64 => {
            format!("{}", value.max(0.0) as u64)
        }
        _ => format!("{}", value as i64),
    }
}

/// The identity of `max`: -inf, or the type's minimum.
fn lowest(elem: ElementType) -> f64 {
    match elem {
        ElementType::S8 => i8::MIN as f64,
        ElementType::S16 => i16::MIN as f64,
        ElementType::S32 => i32::MIN as f64,
        ElementType::S64 => i64::MIN as f64,
        e if is_unsigned(e) => 0.0,
        _ => f64::NEG_INFINITY,
    }
}

/// The identity of `min`: +inf, or the type's maximum.
fn highest(elem: ElementType) -> f64 {
    match elem {
        ElementType::S8 => i8::MAX as f64,
        ElementType::S16 => i16::MAX as f64,
        ElementType::S32 => i32::MAX as f64,
        ElementType::S64 => i64::MAX as f64,
        ElementType::U8 => u8::MAX as f64,
        ElementType::U16 => u16::MAX as f64,
        ElementType::U32 => u32::MAX as f64,
        ElementType::U64 => u64::MAX as f64,
        ElementType::Pred => 1.0,
        _ => f64::INFINITY,
    }
}

fn lowest_finite(elem: ElementType) -> f64 {
    match elem {
        ElementType::F64 => f64::MIN,
        _ => f32::MIN as f64,
    }
}

fn min_positive(elem: ElementType) -> f64 {
    match elem {
        ElementType::F64 => f64::MIN_POSITIVE,
        _ => f32::MIN_POSITIVE as f64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn_backend::Shape;
    use burn_ir::TensorStatus;

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
