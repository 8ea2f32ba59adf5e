//! Compiled mode's hook into a model: one part of it (the VAE's decoder, its encoder, CLIP's
//! layers, T5's blocks) run as a single program in place of its ops.
//!
//! Where this sits: models only hold and call programs; the pipelines build them (on PJRT
//! devices, through backend-tpu's compiled functions) and install them. A model whose slot is
//! empty, or whose program declines a call, runs its own ops, so the numbers never depend on
//! whether a program is installed, only the speed does.

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

/// A part of a model as one program: `I` in (a tensor, or a tuple of them), a tensor of rank
/// `O` out.
pub trait TensorProgram<B: Backend, I, const O: usize>: Send + Sync {
    /// The part's output for `input`, or `None` when the program cannot run it (it reports
    /// why itself); the model then runs its own ops.
    fn run(&self, input: I) -> Option<Tensor<B, O>>;

    /// The program as `Any`, for whoever installed it to read its own counts back.
    fn as_any(&self) -> &dyn Any;
}

/// One installed [`TensorProgram`], or none. It names no backend because a Burn module's
/// skipped fields cannot (the derive maps modules between backends); [`get`](Self::get)
/// finds the program again for the backend it was installed for.
#[derive(Clone, Default)]
pub struct ProgramSlot {
    program: Option<Arc<dyn Any + Send + Sync>>,
}

impl fmt::Debug for ProgramSlot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.program.is_some() {
            "ProgramSlot(installed)"
        } else {
            "ProgramSlot(empty)"
        })
    }
}

impl ProgramSlot {
    /// Installs `program`, replacing any other.
    pub fn install<B: Backend, I: 'static, const O: usize>(
        &mut self,
        program: Arc<dyn TensorProgram<B, I, O>>,
    ) {
        self.program = Some(Arc::new(program));
    }

    /// Empties the slot: the model runs its ops again.
    pub fn clear(&mut self) {
        self.program = None;
    }

    /// The installed program, when it was installed for backend `B`, input `I` and rank `O`.
    pub fn get<B: Backend, I: 'static, const O: usize>(
        &self,
    ) -> Option<&Arc<dyn TensorProgram<B, I, O>>> {
        self.program.as_ref()?.downcast_ref()
    }

    /// The program's output for `input`, or `ops(input)` when none is installed for `B` or it
    /// declines.
    pub fn run_or<B: Backend, I: Clone + 'static, const O: usize>(
        &self,
        input: I,
        ops: impl FnOnce(I) -> Tensor<B, O>,
    ) -> Tensor<B, O> {
        match self.get::<B, I, O>() {
            Some(program) => match program.run(input.clone()) {
                Some(output) => output,
                None => ops(input),
            },
            None => ops(input),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn_flex::Flex;

    type B = Flex;

    struct Doubles;

    impl TensorProgram<B, Tensor<B, 2>, 2> for Doubles {
        fn run(&self, input: Tensor<B, 2>) -> Option<Tensor<B, 2>> {
            Some(input.mul_scalar(2.0))
        }
        fn as_any(&self) -> &dyn Any {
            self
        }
    }

    struct Declines;

    impl TensorProgram<B, Tensor<B, 2>, 2> for Declines {
        fn run(&self, _: Tensor<B, 2>) -> Option<Tensor<B, 2>> {
            None
        }
        fn as_any(&self) -> &dyn Any {
            self
        }
    }

    fn ones() -> Tensor<B, 2> {
        Tensor::ones([1, 2], &Default::default())
    }

    fn first(t: Tensor<B, 2>) -> f32 {
        t.into_data().to_vec::<f32>().unwrap()[0]
    }

    #[test]
    fn a_slot_runs_its_program_or_the_ops() {
        let ops = |x: Tensor<B, 2>| x.add_scalar(10.0);
        let mut slot = ProgramSlot::default();
        assert_eq!(first(slot.run_or(ones(), ops)), 11.0, "empty: the ops");
        slot.install::<B, Tensor<B, 2>, 2>(Arc::new(Doubles));
        assert_eq!(first(slot.run_or(ones(), ops)), 2.0, "the program");
        assert!(
            slot.get::<B, Tensor<B, 2>, 3>().is_none(),
            "another output rank finds nothing"
        );
        slot.install::<B, Tensor<B, 2>, 2>(Arc::new(Declines));
        assert_eq!(first(slot.run_or(ones(), ops)), 11.0, "declined: the ops");
        slot.clear();
        assert!(slot.get::<B, Tensor<B, 2>, 2>().is_none());
    }
}
