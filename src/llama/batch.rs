//! An owned `llama_batch`: token rows (ids) or embedding rows (drafter feature injection).
use super::{LlamaError, Result, Token};
use llama_cpp_sys_2 as sys;

pub struct Batch {
    raw: sys::llama_batch,
    capacity: usize,
    /// Width of an embedding row; 0 for a token batch.
    n_embd: usize,
    n_seq_max: usize,
}

// The batch owns plain heap arrays; nothing in it is tied to a thread.
unsafe impl Send for Batch {}

impl Drop for Batch {
    fn drop(&mut self) {
        unsafe { sys::llama_batch_free(self.raw) }
    }
}

impl Batch {
    /// A token batch of up to `capacity` rows, each in up to `n_seq_max` sequences.
    pub fn tokens(capacity: usize, n_seq_max: usize) -> Self {
        Self::alloc(capacity, 0, n_seq_max)
    }

    /// An embedding batch of up to `capacity` rows of `n_embd` floats.
    pub fn embeddings(capacity: usize, n_embd: usize) -> Self {
        Self::alloc(capacity, n_embd, 1)
    }

    fn alloc(capacity: usize, n_embd: usize, n_seq_max: usize) -> Self {
        let capacity = capacity.max(1);
        let raw = unsafe { sys::llama_batch_init(capacity as i32, n_embd as i32, n_seq_max.max(1) as i32) };
        Self { raw, capacity, n_embd, n_seq_max: n_seq_max.max(1) }
    }

    pub fn len(&self) -> usize {
        self.raw.n_tokens as usize
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn clear(&mut self) {
        self.raw.n_tokens = 0;
    }

    /// Append a row at position `pos` belonging to `seqs`; `output` asks for its logits.
    pub fn add_token(&mut self, token: Token, pos: i32, seqs: &[i32], output: bool) -> Result<()> {
        if self.n_embd != 0 {
            return Err(LlamaError::Invalid("token row added to an embedding batch".into()));
        }
        let i = self.next_row(seqs)?;
        unsafe { *self.raw.token.add(i) = token };
        self.fill_row(i, pos, seqs, output);
        Ok(())
    }

    /// Append an embedding row (exactly `n_embd` floats) at `pos` in sequence `seq`.
    pub fn add_embedding(&mut self, row: &[f32], pos: i32, seq: i32, output: bool) -> Result<()> {
        if row.len() != self.n_embd || self.n_embd == 0 {
            return Err(LlamaError::Invalid(format!(
                "embedding row of {} floats for a batch of width {}",
                row.len(),
                self.n_embd
            )));
        }
        let i = self.next_row(&[seq])?;
        unsafe { std::ptr::copy_nonoverlapping(row.as_ptr(), self.raw.embd.add(i * self.n_embd), self.n_embd) };
        self.fill_row(i, pos, &[seq], output);
        Ok(())
    }

    fn next_row(&self, seqs: &[i32]) -> Result<usize> {
        let i = self.len();
        if i >= self.capacity {
            return Err(LlamaError::Invalid(format!("batch full ({} rows)", self.capacity)));
        }
        if seqs.is_empty() || seqs.len() > self.n_seq_max {
            return Err(LlamaError::Invalid(format!("a row needs 1..={} sequence ids", self.n_seq_max)));
        }
        Ok(i)
    }

    fn fill_row(&mut self, i: usize, pos: i32, seqs: &[i32], output: bool) {
        unsafe {
            *self.raw.pos.add(i) = pos;
            *self.raw.n_seq_id.add(i) = seqs.len() as i32;
            let dst = *self.raw.seq_id.add(i);
            std::ptr::copy_nonoverlapping(seqs.as_ptr(), dst, seqs.len());
            *self.raw.logits.add(i) = output as i8;
        }
        self.raw.n_tokens += 1;
    }

    pub(super) fn raw(&self) -> sys::llama_batch {
        self.raw
    }
}
