//! Comparators: bit-exact (naming the first differing row/column and both values), bounded
//! (within a per-element error bound of an exact f64 value) and DeepEP's `calc_diff`.

use half::bf16;
use std::fmt::Debug;

/// `Ok(())` or a message that says what differs, where, and by how much.
pub type CheckResult = std::result::Result<(), String>;

/// Element types that can be compared bit for bit and printed with their bits.
pub trait Bits: Copy + Debug {
    fn bits(self) -> u64;
    fn to_f64(self) -> f64;
}

macro_rules! int_bits {
    ($($t:ty),*) => {$(
        impl Bits for $t {
            fn bits(self) -> u64 { self as u64 }
            fn to_f64(self) -> f64 { self as f64 }
        }
    )*};
}
int_bits!(u8, i8, u16, i16, u32, i32, u64, i64, usize);

impl Bits for bool {
    fn bits(self) -> u64 {
        u64::from(self)
    }
    fn to_f64(self) -> f64 {
        f64::from(u8::from(self))
    }
}
impl Bits for f32 {
    fn bits(self) -> u64 {
        u64::from(self.to_bits())
    }
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
}
impl Bits for f64 {
    fn bits(self) -> u64 {
        self.to_bits()
    }
    fn to_f64(self) -> f64 {
        self
    }
}
impl Bits for bf16 {
    fn bits(self) -> u64 {
        u64::from(self.to_bits())
    }
    fn to_f64(self) -> f64 {
        bf16::to_f64(self)
    }
}

/// Bit-exact comparison of `got` against `want`, both `[rows, cols]` row-major (`cols >= 1`).
/// Floats are compared by bits (so `-0.0 != 0.0`, and NaNs must match bit for bit). The error
/// names the first differing row and column, both values with their bits, and how many elements
/// differ in total.
pub fn bit_exact<T: Bits>(what: &str, got: &[T], want: &[T], cols: usize) -> CheckResult {
    let cols = cols.max(1);
    if got.len() != want.len() {
        return Err(format!(
            "{what}: length {} (= {} rows of {cols}) but expected {} (= {} rows)",
            got.len(),
            got.len() as f64 / cols as f64,
            want.len(),
            want.len() as f64 / cols as f64
        ));
    }
    all_pass(got.iter().zip(want).map(|(g, w)| g.bits() != w.bits()), |i, count| {
        format!(
            "{what}: first mismatch at {}: got {:?} (bits {:#x}), expected {:?} (bits {:#x}); {count} of {} elements differ",
            position(i, cols),
            got[i],
            got[i].bits(),
            want[i],
            want[i].bits(),
            got.len()
        )
    })
}

/// Ok when no element fails; else the error `describe(index of the first failing element, how
/// many fail)`.
fn all_pass(fails: impl Iterator<Item = bool>, describe: impl FnOnce(usize, usize) -> String) -> CheckResult {
    let mut first = None;
    let mut count = 0usize;
    for (i, fail) in fails.enumerate() {
        if fail {
            count += 1;
            first.get_or_insert(i);
        }
    }
    match first {
        None => Ok(()),
        Some(i) => Err(describe(i, count)),
    }
}

/// `row R, column C` of element `i` of a row-major `[rows, cols]` array.
fn position(i: usize, cols: usize) -> String {
    format!("row {}, column {}", i / cols, i % cols)
}

/// DeepEP's similarity measure: `1 − 2·Σ(x+1)(y+1) / Σ((x+1)² + (y+1)²)`, in f64. 0 means equal.
pub fn calc_diff<A: Bits, B: Bits>(x: &[A], y: &[B]) -> f64 {
    assert_eq!(x.len(), y.len(), "calc_diff: length mismatch");
    let (mut num, mut den) = (0f64, 0f64);
    for (a, b) in x.iter().zip(y) {
        let (a, b) = (a.to_f64() + 1.0, b.to_f64() + 1.0);
        num += a * b;
        den += a * a + b * b;
    }
    if den == 0.0 {
        return 0.0;
    }
    1.0 - 2.0 * num / den
}

/// Expected values with an exact reference and a per-element error bound, `[rows, cols]`.
///
/// `value` is what the CPU computes in the contract's operation order (bit-identical to a GPU that
/// uses the same order); `exact` is the f64 value of the mathematically exact result of the same
/// terms; `bound` is a rigorous bound on `|gpu − exact|` for any GPU summation order (see
/// [`super::numeric::bf16_sum_bound`]). [`Bounded::check`] accepts a GPU result iff every element
/// satisfies `|gpu − exact| <= bound`.
#[derive(Debug, Clone, PartialEq)]
pub struct Bounded<T> {
    pub cols: usize,
    pub value: Vec<T>,
    pub exact: Vec<f64>,
    pub bound: Vec<f64>,
}

impl<T: Bits> Bounded<T> {
    pub fn new(cols: usize) -> Self {
        Bounded { cols, value: Vec::new(), exact: Vec::new(), bound: Vec::new() }
    }

    pub fn with_capacity(cols: usize, n: usize) -> Self {
        Bounded { cols, value: Vec::with_capacity(n), exact: Vec::with_capacity(n), bound: Vec::with_capacity(n) }
    }

    pub fn push(&mut self, value: T, exact: f64, bound: f64) {
        self.value.push(value);
        self.exact.push(exact);
        self.bound.push(bound);
    }

    pub fn rows(&self) -> usize {
        self.value.len() / self.cols.max(1)
    }

    /// Accept `got` iff `|got − exact| <= bound` everywhere (NaN never passes). The error names
    /// the first offending row/column with the GPU value, the reference value, the exact value
    /// and the bound, plus the number of offending elements.
    pub fn check(&self, what: &str, got: &[T]) -> CheckResult {
        if got.len() != self.value.len() {
            return Err(format!("{what}: length {} but expected {} ({} rows of {})", got.len(), self.value.len(), self.rows(), self.cols));
        }
        let cols = self.cols.max(1);
        let out_of_bounds = got.iter().enumerate().map(|(i, g)| {
            let err = (g.to_f64() - self.exact[i]).abs();
            err.is_nan() || err > self.bound[i]
        });
        all_pass(out_of_bounds, |i, count| {
            format!(
                "{what}: {}: got {:?}, reference {:?}, exact {:e}, |error| {:e} exceeds the bound {:e}; {count} of {} elements out of bounds",
                position(i, cols),
                got[i],
                self.value[i],
                self.exact[i],
                (got[i].to_f64() - self.exact[i]).abs(),
                self.bound[i],
                got.len()
            )
        })
    }

    /// Bit-exact check against [`Bounded::value`] (only meaningful when the GPU sums in the
    /// contract's order).
    pub fn check_bit_exact(&self, what: &str, got: &[T]) -> CheckResult {
        bit_exact(what, got, &self.value, self.cols)
    }
}
