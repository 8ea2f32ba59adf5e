//! Lowerings of the float-only ops: transcendental functions, rounding,
//! float checks, and random numbers through `stablehlo.rng_bit_generator`.

use std::fmt::Write as _;

use burn_backend::Distribution;
use burn_ir::{FloatOperationIr, ScalarIr};

use super::{is_float, Argument, Lowerer, Result, TensorType, Value};
use crate::pjrt::ElementType;

impl Lowerer {
    pub(super) fn lower_float(&mut self, op: &FloatOperationIr) -> Result<()> {
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

    /// Random numbers from `stablehlo.rng_bit_generator` (Threefry), its
    /// state an argument the caller draws from its seeded generator.
    pub(super) fn random(&mut self, ty: &TensorType, distribution: Distribution) -> Result<Value> {
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
