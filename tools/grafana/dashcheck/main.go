// dashcheck checks Grafana dashboards, as JSON files in Grafana's classic (v1) model, with
// the Grafana Foundation SDK (github.com/grafana/grafana-foundation-sdk/go dashboard):
//
//	dashcheck FILE...
//	FILE: ok
//	FILE: decode: panels[3].gridpos: unexpected field 'gridpos'
//	FILE: validate: fiscalYearStartMonth: must be < 12
//
// Each file is decoded with Dashboard.UnmarshalJSONStrict, which rejects required fields
// that are missing, fields of the wrong type and fields the schema does not know, in the
// panels' options and queries too (the SDK's plugin registry types them by panel and data
// source type). Then Dashboard.Validate checks the schema's constraints. Every error is
// printed on stdout, one a line, after its file's name. The exit status is 0 when every
// file passes, 1 when any does not and 2 when a file cannot be read.
//
// Built by hack/build-grafana-tools.sh against the pinned SDK release.
package main

import (
	"errors"
	"fmt"
	"os"

	"github.com/grafana/grafana-foundation-sdk/go/cog"
	"github.com/grafana/grafana-foundation-sdk/go/cog/plugins"
	"github.com/grafana/grafana-foundation-sdk/go/dashboard"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: dashcheck DASHBOARD.json...")
		os.Exit(2)
	}
	// Without the registry a panel's options and a query are opaque maps, and strict
	// decoding never looks inside them.
	plugins.RegisterDefaultPlugins()
	failed := false
	for _, path := range os.Args[1:] {
		raw, err := os.ReadFile(path)
		if err != nil {
			fmt.Fprintf(os.Stderr, "dashcheck: %v\n", err)
			os.Exit(2)
		}
		problems := check(raw)
		for _, p := range problems {
			fmt.Printf("%s: %s\n", path, p)
		}
		if len(problems) == 0 {
			fmt.Printf("%s: ok\n", path)
		}
		failed = failed || len(problems) > 0
	}
	if failed {
		os.Exit(1)
	}
}

// check returns one line per error: the strict decoder's, then Validate's, which runs
// only on a dashboard that decoded.
func check(raw []byte) []string {
	board := dashboard.Dashboard{}
	if found := lines("decode", board.UnmarshalJSONStrict(raw)); len(found) > 0 {
		return found
	}
	return lines("validate", board.Validate())
}

// lines spells out err, one line per error it holds. The strict decoder returns its
// cog.BuildErrors even when that is empty, a non-nil error that holds none: that is a
// pass, not a failure without a message.
func lines(stage string, err error) []string {
	if err == nil {
		return nil
	}
	var many cog.BuildErrors
	if !errors.As(err, &many) {
		return []string{fmt.Sprintf("%s: %v", stage, err)}
	}
	out := make([]string, 0, len(many))
	for _, e := range many {
		out = append(out, fmt.Sprintf("%s: %s: %s", stage, e.Path, e.Message))
	}
	return out
}
