package bound_test

import (
	"testing"
	"time"

	"github.com/giantswarm/vm-manager/pkg/bound"
)

func TestDefault(t *testing.T) {
	for _, c := range []struct{ v, want int }{{0, 7}, {-1, 7}, {3, 3}} {
		v := c.v
		bound.Default(&v, 7)
		if v != c.want {
			t.Errorf("Default(%d, 7) = %d, want %d", c.v, v, c.want)
		}
	}
	d := time.Duration(0)
	bound.Default(&d, time.Second)
	if d != time.Second {
		t.Errorf("Default(0s, 1s) = %s", d)
	}
	f := 2.5
	bound.Default(&f, 20)
	if f != 2.5 {
		t.Errorf("Default(2.5, 20) = %v", f)
	}
}
