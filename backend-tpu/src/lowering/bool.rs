//! Lowerings of the bool-only ops: logic and casts.

use burn_ir::BoolOperationIr;

use super::{Lowerer, Result};

impl Lowerer {
    pub(super) fn lower_bool(&mut self, op: &BoolOperationIr) -> Result<()> {
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
}
