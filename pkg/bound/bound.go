// Package bound holds the rule every configurable bound follows: zero (left
// out) or negative takes the bound's default.
package bound

// Number is what a bound is counted in: a count, a size, a rate or a
// duration (time.Duration is an int64).
type Number interface {
	~int | ~int32 | ~int64 | ~float64
}

// Default sets *v to def when *v is zero or negative. A Limits type's
// defaults method is one call a field:
//
//	bound.Default(&l.MaxVMs, DefaultMaxVMs)
func Default[T Number](v *T, def T) {
	if *v <= 0 {
		*v = def
	}
}
