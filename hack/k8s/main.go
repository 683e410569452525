// Command kube is a multi-call binary holding the Kubernetes control-plane
// components kubestrata's tests and local federations run: kube-apiserver,
// kube-controller-manager, kube-scheduler, etcd and kubectl, all built from the
// published Go modules. It dispatches on the name it was called by (symlinks)
// or, when called as "kube", on its first argument.
package main

import (
	"fmt"
	"os"
	"path/filepath"

	"github.com/spf13/cobra"
	"go.etcd.io/etcd/server/v3/etcdmain"
	"k8s.io/component-base/cli"
	kubectl "k8s.io/kubectl/pkg/cmd"
	kubectlutil "k8s.io/kubectl/pkg/cmd/util"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
)

var components = map[string]func() *cobra.Command{
	"kube-apiserver":          apiserver.NewAPIServerCommand,
	"kube-controller-manager": controllermanager.NewControllerManagerCommand,
	"kube-scheduler":          func() *cobra.Command { return scheduler.NewSchedulerCommand() },
}

func main() {
	name := filepath.Base(os.Args[0])
	args := os.Args[1:]
	if name == "kube" {
		if len(args) == 0 {
			fmt.Fprintln(os.Stderr, "usage: kube {kube-apiserver|kube-controller-manager|kube-scheduler|etcd|kubectl} [flags]")
			os.Exit(2)
		}
		name, args = args[0], args[1:]
	}
	switch name {
	case "etcd":
		// etcdmain reads os.Args itself and expects the program name first.
		etcdmain.Main(append([]string{"etcd"}, args...))
		return
	case "kubectl":
		// kubectl's plugin handling reads os.Args, so present it as a plain kubectl call.
		os.Args = append([]string{"kubectl"}, args...)
		if err := cli.RunNoErrOutput(kubectl.NewDefaultKubectlCommand()); err != nil {
			kubectlutil.CheckErr(err)
		}
		return
	}
	newCommand, ok := components[name]
	if !ok {
		fmt.Fprintf(os.Stderr, "kube: unknown component %q\n", name)
		os.Exit(2)
	}
	command := newCommand()
	command.SetArgs(args)
	os.Exit(cli.Run(command))
}
