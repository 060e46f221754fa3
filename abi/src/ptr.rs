//! Device addresses as kernel arguments: [`GlobalPtr`] (the kernel only reads through it) and
//! [`GlobalPtrMut`] (it may write), typed by element.
//!
//! Each is one pointer (8 bytes, `#[repr(transparent)]`) inside a kernel's `#[repr(C)]`
//! argument struct, so host and kernel agree on the bytes. The host builds them from the
//! addresses of its device buffers (`lserve`'s launcher registers each buffer, read or written,
//! with the stream first); a kernel turns them back into raw pointers with `get`. The host never
//! dereferences one.

use core::marker::PhantomData;

/// The global-memory address of `T` elements a kernel reads (never writes) through.
///
/// ```
/// use lserve_abi::ptr::GlobalPtr;
/// let p = GlobalPtr::<u32>::from_addr(0x7f00_0000_1000);
/// assert_eq!(p.addr(), 0x7f00_0000_1000);
/// assert_eq!(GlobalPtr::<u32>::NULL.addr(), 0);
/// ```
#[repr(transparent)]
pub struct GlobalPtr<T> {
    ptr: *const T,
    _elem: PhantomData<T>,
}

/// The global-memory address of `T` elements a kernel may write (and read) through.
///
/// ```
/// use lserve_abi::ptr::GlobalPtrMut;
/// let p = GlobalPtrMut::<f32>::from_addr(0x1000);
/// assert_eq!((p.addr(), p.read_only().addr()), (0x1000, 0x1000));
/// ```
#[repr(transparent)]
pub struct GlobalPtrMut<T> {
    ptr: *mut T,
    _elem: PhantomData<T>,
}

macro_rules! pointer_impls {
    ($name:ident, $raw:ty, $rawu:ty) => {
        impl<T> $name<T> {
            /// No buffer (a kernel given it must not dereference it).
            pub const NULL: Self = Self::from_addr(0);

            /// The pointer to the device address `addr` (`CUdeviceptr`).
            #[inline(always)]
            pub const fn from_addr(addr: u64) -> Self {
                Self {
                    ptr: addr as usize as $raw,
                    _elem: PhantomData,
                }
            }

            /// The device address.
            #[inline(always)]
            pub fn addr(self) -> u64 {
                self.ptr as usize as u64
            }

            /// The same address as a pointer to `U` elements (a kernel reads 16-bit floats as
            /// `u16` bits).
            #[inline(always)]
            pub const fn cast<U>(self) -> $name<U> {
                $name {
                    ptr: self.ptr as $rawu,
                    _elem: PhantomData,
                }
            }

            /// The raw pointer (dereferenced by kernels only).
            #[inline(always)]
            pub const fn get(self) -> $raw {
                self.ptr
            }
        }

        impl<T> Clone for $name<T> {
            #[inline(always)]
            fn clone(&self) -> Self {
                *self
            }
        }

        impl<T> Copy for $name<T> {}

        impl<T> core::fmt::Debug for $name<T> {
            fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
                write!(f, "{}({:#x})", stringify!($name), self.addr())
            }
        }

        impl<T> PartialEq for $name<T> {
            fn eq(&self, other: &Self) -> bool {
                self.addr() == other.addr()
            }
        }

        impl<T> Eq for $name<T> {}

        // SAFETY: an address in device memory, which the host side never dereferences; sending
        // or sharing the value shares no host memory.
        unsafe impl<T> Send for $name<T> {}
        // SAFETY: as for `Send`.
        unsafe impl<T> Sync for $name<T> {}
    };
}

pointer_impls!(GlobalPtr, *const T, *const U);
pointer_impls!(GlobalPtrMut, *mut T, *mut U);

impl<T> GlobalPtrMut<T> {
    /// The same address, read only (for a kernel that only reads what another writes).
    #[inline(always)]
    pub const fn read_only(self) -> GlobalPtr<T> {
        GlobalPtr {
            ptr: self.ptr as *const T,
            _elem: PhantomData,
        }
    }
}
