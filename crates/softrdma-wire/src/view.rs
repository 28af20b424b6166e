//! Shared pieces of the zero-copy views.

/// Implements `new_unchecked`, `new_checked` and `into_inner` for a view
/// `$view<T>` (a struct with one field, `buffer: T`) over a message of the
/// fixed length `$len`, named `$what` in errors.
macro_rules! fixed_len_view {
    ($view:ident, $len:expr, $what:expr) => {
        impl<T: AsRef<[u8]>> $view<T> {
            /// Wraps a buffer without checking its length (accessors of a
            /// short buffer return zeroes).
            #[inline]
            pub const fn new_unchecked(buffer: T) -> Self {
                Self { buffer }
            }

            /// Wraps a buffer, checking that it holds the whole message.
            ///
            /// # Errors
            ///
            /// [`DecodeError::Truncated`](crate::DecodeError::Truncated) if it
            /// does not.
            pub fn new_checked(buffer: T) -> Result<Self, $crate::DecodeError> {
                let got = buffer.as_ref().len();
                if got < $len {
                    return Err($crate::DecodeError::Truncated {
                        what: $what,
                        needed: $len,
                        got,
                    });
                }
                Ok(Self { buffer })
            }

            /// Returns the underlying buffer.
            #[inline]
            pub fn into_inner(self) -> T {
                self.buffer
            }
        }
    };
}

pub(crate) use fixed_len_view;
