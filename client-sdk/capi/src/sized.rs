//! Structs that grow (SDK issue item 5): a caller passes `sizeof` of the struct as its
//! header had it; the library copies only that many bytes in or out, so a program built
//! against an older header never reads or writes past its own struct, and fields it does
//! not know take their defaults.

/// Copies the first `min(size, size_of::<T>())` bytes of `value` to `out`.
///
/// # Safety
///
/// `out` is writable for that many bytes.
pub(crate) unsafe fn write_prefix<T: Copy>(out: *mut T, value: &T, size: usize) {
    let n = size.min(std::mem::size_of::<T>());
    // SAFETY: `value` is readable for size_of::<T>() >= n bytes; the caller promises `out`
    // is writable for n bytes; the two never overlap (`value` is the library's own copy).
    unsafe {
        std::ptr::copy_nonoverlapping((value as *const T).cast::<u8>(), out.cast::<u8>(), n);
    }
}

/// Copies the first `min(size, size_of::<T>())` bytes of `*from` over `into`.
///
/// # Safety
///
/// `from` is readable for that many bytes.
pub(crate) unsafe fn read_prefix<T: Copy>(from: *const T, into: &mut T, size: usize) {
    let n = size.min(std::mem::size_of::<T>());
    // SAFETY: the caller promises n readable bytes at `from`; `into` is writable for
    // size_of::<T>() >= n bytes; a caller's struct is never the library's local copy.
    unsafe {
        std::ptr::copy_nonoverlapping(from.cast::<u8>(), (into as *mut T).cast::<u8>(), n);
    }
}
