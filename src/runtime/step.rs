//! `Step`: what a step of a [`KvRuntime`](super::KvRuntime) may touch of the K/V bytes.
//!
//! Invariants:
//! - A step holds its own copy of the arrays that address the K/V bytes (slot mapping, block
//!   tables, context lengths, query offsets, copy-on-write ops), made when the runtime scheduled
//!   it. Whatever a caller does with the arrays it was handed (the binding moves them into numpy
//!   arrays Python may write to), the runtime writes and reads only where the scheduler put the
//!   step.
//! - Only the runtime makes steps (the fields are private), so a `Step` is always one its
//!   runtime scheduled; whether it still awaits `finish_step` is the gate's to say.

use crate::ids::CopyOp;
use crate::scheduler::{StepId, StepOutput};

/// The K/V addressing of one scheduled step.
#[derive(Debug, Clone)]
pub struct Step {
    pub(super) id: StepId,
    pub(super) slot_mapping: Vec<i64>,
    pub(super) query_start_loc: Vec<i32>,
    pub(super) context_lens: Vec<i32>,
    pub(super) block_tables: Vec<i32>,
    pub(super) block_table_width: usize,
    pub(super) copy_ops: Vec<CopyOp>,
}

impl Step {
    /// The addressing of `output`, copied (a few integers per token and sequence).
    pub(super) fn of(output: &StepOutput) -> Step {
        Step {
            id: output.id,
            slot_mapping: output.slot_mapping.clone(),
            query_start_loc: output.query_start_loc.clone(),
            context_lens: output.context_lens.clone(),
            block_tables: output.block_tables.clone(),
            block_table_width: output.block_table_width,
            // Block ids come from the pool, below MAX_NUM_BLOCKS: they fit u32.
            copy_ops: output
                .copy_ops
                .chunks_exact(2)
                .map(|pair| CopyOp {
                    src: pair[0] as u32,
                    dst: pair[1] as u32,
                })
                .collect(),
        }
    }

    /// A step of a runtime without K/V: its id only (it addresses nothing, so nothing is
    /// copied: `bench scheduler` runs a runtime without K/V).
    pub(super) fn without_kv(output: &StepOutput) -> Step {
        Step {
            id: output.id,
            slot_mapping: Vec::new(),
            query_start_loc: Vec::new(),
            context_lens: Vec::new(),
            block_tables: Vec::new(),
            block_table_width: 0,
            copy_ops: Vec::new(),
        }
    }

    /// Which step of which scheduler this is.
    pub fn id(&self) -> StepId {
        self.id
    }

    /// Tokens in the step.
    pub fn num_tokens(&self) -> usize {
        self.query_start_loc.last().map_or(0, |&n| n as usize)
    }

    /// Group `group`'s slot of each token.
    pub(super) fn group_slots(&self, group: usize) -> &[i64] {
        let n = self.num_tokens();
        &self.slot_mapping[group * n..][..n]
    }

    /// Group `group`'s block table of each row (`[num_seqs, block_table_width]`).
    pub(super) fn group_tables(&self, group: usize) -> &[i32] {
        let n = self.context_lens.len() * self.block_table_width;
        &self.block_tables[group * n..][..n]
    }
}
